"""The mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) against transformers on tiny
random checkpoints: through the executor (prefill, decode, chunked and mixed batches, eager and
with graphs), greedy through EngineCore and ``xhal-serve --device cpu``, TP=2 against TP=1, and
the loader's errors for missing, unexpected and mis-shaped expert tensors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import WeightsMismatchError, load_model
from tests.executor.test_executor import Harness, prompts, rel_err
from tests.executor.test_tensor_parallel import tp2_matches_tp1
from tests.support.checkpoints import MOE_BUILDERS, qwen3_moe
from xhal.interfaces import BatchKind

transformers = pytest.importorskip("transformers")

RTOL = 1e-4
MOE = sorted(MOE_BUILDERS)


# graphs for the two the issue names; Qwen2-MoE's shared expert changes nothing a graph sees
HARNESS_CASES = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True), ("mixtral", False),
                 ("qwen2_moe", True)]


@pytest.fixture(params=HARNESS_CASES, ids=lambda p: f"{p[0]}-{'eager' if p[1] else 'graphs'}")
def harness(request, checkpoint_factory) -> Harness:
    name, eager = request.param
    return Harness(checkpoint_factory(name), enforce_eager=eager, seed=2)


def test_prefill_decode_chunked_and_mixed_match_transformers(harness: Harness) -> None:
    """One request stream: a prefill of three lengths, decodes (graph replays with graphs), a
    chunked prefill and a mixed step, every token's logits against transformers."""
    a, b, c = prompts(harness.vocab, [5, 23, 40])
    logits, meta = harness.step([(0, a), (1, b), (2, c[:16])])
    assert meta.kind == BatchKind.PREFILL
    assert rel_err(logits[:5], harness.reference(a)) < RTOL
    assert rel_err(logits[5:28], harness.reference(b)) < RTOL
    assert rel_err(logits[28:], harness.reference(c[:16])) < RTOL
    for step in range(3):
        new = [random.Random(step * 10 + i).randrange(harness.vocab) for i in range(2)]
        logits, meta = harness.step([(0, [new[0]]), (1, [new[1]])])
        assert meta.kind == BatchKind.DECODE
        a, b = a + [new[0]], b + [new[1]]
        assert rel_err(logits[0], harness.reference(a)[-1]) < RTOL
        assert rel_err(logits[1], harness.reference(b)[-1]) < RTOL
    logits, meta = harness.step([(2, c[16:30])])
    assert meta.kind == BatchKind.CHUNKED_PREFILL
    assert rel_err(logits, harness.reference(c[:30])[16:30]) < RTOL
    logits, meta = harness.step([(1, [7]), (2, c[30:]), (0, [9])])  # any order
    assert meta.kind == BatchKind.MIXED
    assert rel_err(logits[0], harness.reference(b + [7])[-1]) < RTOL
    assert rel_err(logits[1:11], harness.reference(c)[30:]) < RTOL
    assert rel_err(logits[11], harness.reference(a + [9])[-1]) < RTOL


@pytest.mark.parametrize("name", MOE)
def test_engine_greedy_equals_transformers_generate(name: str, tmp_path: Path) -> None:
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.core import EngineCore
    from serve_cli.engine.offline import generate
    from serve_cli.engine.sampling import SamplingParams

    path = MOE_BUILDERS[name](tmp_path / name, tokenizer=True)  # the engine detokenizes
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = prompts(256, [6, 17], seed=3)
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([s]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
                0, len(s) :
            ].tolist()
            for s in seqs
        ]
    engine = EngineCore(EngineConfig(model_dir=path, max_model_len=128, num_kv_blocks=32))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert generate(engine, seqs, params) == expected


def test_xhal_serve_greedy_equals_transformers_generate(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    import openai

    from tests.support.launcher import ServerProcess

    path = qwen3_moe(tmp_path / "qwen3_moe", tokenizer=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    texts = ["the quick brown fox jumps", "hello world this is a tiny tokenizer"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            out = hf.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
            expected.append(out[0, ids.shape[1] :].tolist())
    args = ["--model", str(path), "--device", "cpu", "--served-model-name", "moe",
            "--max-model-len", "128", "--num-kv-blocks", "32", "--log-level", "warning"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="moe", prompt=texts, max_tokens=10, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    served = [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]
    assert served == expected


# two process pairs are the slow part of the file: Mixtral with graphs (all-reduces captured),
# Qwen2-MoE eager (experts and shared expert reduced once together)
@pytest.mark.parametrize(("name", "enforce_eager"), [("mixtral", False), ("qwen2_moe", True)],
                         ids=["mixtral-graphs", "qwen2_moe-eager"])
def test_tp2_matches_tp1(checkpoint_factory, name: str, enforce_eager: bool) -> None:
    """Each rank holds half of every expert's intermediate dimension; one all-reduce per MoE
    block (after the experts' and the shared expert's partial sums are added) gives TP=1's
    logits."""
    full, results = tp2_matches_tp1(str(checkpoint_factory(name)), enforce_eager)
    for r in results:
        w13, w2 = (
            r["shapes"]["model.layers.0.mlp.experts.w13_weight"],
            r["shapes"]["model.layers.0.mlp.experts.w2_weight"],
        )
        assert w13[1] * 2 == full["model.layers.0.mlp.experts.w13_weight"][1]
        assert w2[2] * 2 == full["model.layers.0.mlp.experts.w2_weight"][2]
        assert (
            r["shapes"]["model.layers.0.mlp.gate.weight"] == full["model.layers.0.mlp.gate.weight"]
        )


# loader errors ---------------------------------------------------------------------------------


def _edited(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_expert_tensor_is_named(checkpoint_factory, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    bad = _edited(checkpoint_factory("qwen3_moe"), tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(
        WeightsMismatchError, match=r"missing 1 tensor\(s\): " + name.replace(".", r"\.")
    ):
        load_model(bad, progress=False)


def test_unexpected_expert_tensor_is_named(checkpoint_factory, tmp_path: Path) -> None:
    name = "model.layers.0.block_sparse_moe.experts.8.w1.weight"  # the model has experts 0..7

    def add(tensors: dict) -> None:
        tensors[name] = tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()

    bad = _edited(checkpoint_factory("mixtral"), tmp_path / "m", add)
    with pytest.raises(
        WeightsMismatchError, match=r"unexpected 1 tensor\(s\): " + name.replace(".", r"\.")
    ):
        load_model(bad, progress=False)


def test_misshaped_expert_tensor_is_named(checkpoint_factory, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.3.down_proj.weight"

    def shrink(tensors: dict) -> None:
        tensors[name] = tensors[name][:, :16].clone()

    bad = _edited(checkpoint_factory("qwen2_moe"), tmp_path / "m", shrink)
    with pytest.raises(
        WeightsMismatchError,
        match=name.replace(".", r"\.") + r".*expert 3 w2.*\(64, 16\).*\(64, 32\)",
    ):
        load_model(bad, progress=False)


def test_a_sparse_layer_runs_o_inside_the_router_op_on_one_rank(checkpoint_factory) -> None:
    """On one rank a sparse decoder layer hands the attention's output and o's weight to
    ``linear_add_rms_norm_moe_route`` (so a platform may fuse them); its logits still match
    transformers (the test above) and the router's module still runs (xhal-align's hook)."""
    from xhal import ops
    from xhal.platforms.cpu_ref.ops import CpuOps

    calls: list[str] = []

    class Spy(CpuOps):
        def linear_add_rms_norm_moe_route(self, *args):
            calls.append("o + router")
            return super().linear_add_rms_norm_moe_route(*args)

        def add_rms_norm_moe_route(self, *args):
            calls.append("router")
            return super().add_rms_norm_moe_route(*args)

    harness = Harness(checkpoint_factory("qwen3_moe"), enforce_eager=True, seed=2)
    seen = []
    gate = harness.model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda module, args, out: seen.append(out[0].shape))
    with ops.using("cpu", Spy()):
        tokens = prompts(harness.vocab, [6])[0]
        logits, _ = harness.step([(0, tokens)])
    handle.remove()
    layers = len(harness.model.model.layers)
    assert calls == ["o + router", "router"] * layers  # the fused op's default, then its router
    assert seen == [(6, gate.weight.shape[0])]  # [T, E] logits
    assert rel_err(logits, harness.reference(tokens)) < RTOL
