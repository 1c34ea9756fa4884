"""The NPU platform (``xhal/platforms/npu``) on the torch_npu emulation
(``tests/support/npu_emulation``, CPU tensors):

- the whole conformance suite, through ``xhal-conformance --device npu --plugin ...``, passes
  every family;
- full-graph decode through the executor, with sequence lengths (and the batch) changing between
  replays, matches eager decode; with the replay-time FIA update skipped it does not;
- each KV writer (scatter_pa, reshape_and_cache, scatter_nd) and the sampler's two top-k paths.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest
import torch

from tests.support.conformance_run import REPO, explain, run_conformance
from tests.support.npu_emulation.registry import read_counts
from tests.support.npu_emulation_helpers import (
    assert_calls_bound_and_checked,
    emulated_npu_platform,
)
from tests.support.paged_host import PagedHost
from xhal.interfaces import AttentionSpec, BatchKind, LayerCache

PLUGIN = "tests.support.npu_emulation.plugin"
SUITE = REPO / "conformance_tests"
# test_<family>.py, or test_<family>_<topic>.py for a family split over several files
FAMILIES = sorted({p.stem.removeprefix("test_").split("_", 1)[0] for p in SUITE.glob("test_*.py")})
BLOCK_SIZE = 128


# the whole suite ------------------------------------------------------------------------------


def test_conformance_passes_every_family(tmp_path: Path) -> None:
    counts = tmp_path / "counts"
    proc, report = run_conformance(
        "npu", PLUGIN, tmp_path / "npu.json", XHAL_NPU_EMULATION_COUNTS=str(counts)
    )
    assert proc.returncode == 0, explain(proc)
    assert sorted(report["families"]) == FAMILIES, explain(proc)
    for name, fam in report["families"].items():
        assert fam["failed"] == 0 and fam["passed"] > 0, f"family {name}: {fam}\n{explain(proc)}"
    # every emulated op call went through the wheel's schema, and every run of an op the wheel has
    # a meta function for passed it (the totals are printed for docs/npu.md)
    assert_calls_bound_and_checked(read_counts(counts), "conformance")


# the platform in this process -----------------------------------------------------------------


npu = emulated_npu_platform  # the fixture, under the name the tests take


class _WithoutReplayUpdate:
    """Wraps a platform whose attention backends get ``before_replay`` wrong: ``"skip"`` does
    nothing (the captured FIA waits on its update event forever), ``"events_only"`` releases the
    events without re-issuing FIA (it runs with the lengths baked at capture)."""

    def __init__(self, platform, bug: str) -> None:
        self._platform, self._bug = platform, bug

    def __getattr__(self, name: str):
        return getattr(self._platform, name)

    def attention_backend(self, spec: AttentionSpec):
        backend, bug = self._platform.attention_backend(spec), self._bug

        class Broken(type(backend)):
            def before_replay(self, graph_key: Hashable) -> None:
                if bug == "events_only":
                    for captured in self._captured.get(graph_key, {}).values():
                        captured.event.record(self.update_stream)

        backend.__class__ = Broken
        return backend


def _decode_run(
    platform, model, model_dir: Path, enforce_eager: bool, inference: bool = False
) -> list[torch.Tensor]:
    """Prefill four prompts, then decode steps whose batch shrinks and grows inside one bucket of
    4: every replay has other kv lengths (and rows) than the capture. Returns each decode step's
    logits. ``inference``: every step (the graph's capture on the first decode included) under
    ``torch.inference_mode``, as the server runs a platform whose device is the CPU
    (serve_cli/engine/runner/rank.py); the executor and its caches are made before, as there."""
    from xhal.executor import ExecutorConfig, ModelExecutor

    config = ExecutorConfig(
        dtype=torch.bfloat16, block_size=BLOCK_SIZE, max_num_seqs=4, max_model_len=512,
        enforce_eager=enforce_eager, decode_graph_sizes=(4,), piecewise_token_sizes=(),
    )  # fmt: skip
    executor = ModelExecutor(model, platform, config)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=16))
    host = PagedHost(16, BLOCK_SIZE, seed=3)
    prompts = {0: 5, 1: 130, 2: 17, 3: 60}  # prompt lengths, one crossing a block boundary
    chunks = [(s, [(7 * s + j) % 200 + 3 for j in range(n)]) for s, n in prompts.items()]
    logits = []
    with torch.inference_mode(inference):
        executor.execute(*host.step(chunks))
        for step, seqs in enumerate([[0, 1, 2], [0, 1, 2, 3], [1, 3], [3, 0, 2], [2]]):
            ids, pos, meta = host.step([(s, [(11 * step + s) % 200 + 3]) for s in seqs])
            assert meta.kind == BatchKind.DECODE
            hidden = executor.execute(ids, pos, meta)
            logits.append(executor.compute_logits(hidden).clone())
    return logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="the tiny checkpoint is built with transformers")
    from tests.support.checkpoints import build_checkpoint

    # head_dim 128: the head size FIA's TND layout takes (npu.md section 1.4)
    return build_checkpoint(tmp_path_factory.mktemp("npu-llama"), "llama", head_dim=128, seed=7)


@pytest.fixture
def model(npu, model_dir: Path) -> torch.nn.Module:
    from models.loader import load_model

    return load_model(model_dir, dtype=torch.bfloat16, progress=False)


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_graph_decode_matches_eager_as_lengths_change(
    npu, model, model_dir: Path, inference: bool
) -> None:
    """Every step's logits, by the bucket's captured LM head for the graph run, equal eager's. In
    inference mode the LM head's float cast reaches the graph recorder as one ``to.dtype``, whose
    schema may alias: a recorder that trusted the schema replayed stale logits (the served
    emulated NPU then repeated one token)."""
    eager = _decode_run(npu, model, model_dir, enforce_eager=True, inference=inference)
    graph = _decode_run(npu, model, model_dir, enforce_eager=False, inference=inference)
    for step, (g, e) in enumerate(zip(graph, eager)):
        assert torch.equal(g, e), f"decode step {step}: graph replay != eager"


@pytest.mark.parametrize("bug", ["skip", "events_only"])
def test_graph_decode_without_the_replay_update_fails(
    npu, model, model_dir: Path, bug: str
) -> None:
    eager = _decode_run(npu, model, model_dir, enforce_eager=True)
    try:
        stale = _decode_run(_WithoutReplayUpdate(npu, bug), model, model_dir, enforce_eager=False)
    except RuntimeError as err:  # a replay left waiting on its update event (a hang on a device)
        assert bug == "skip" and "blocked" in str(err), err
        return
    assert bug == "events_only", "a replay never released by its event ran to the end"
    wrong = [step for step, (s, e) in enumerate(zip(stale, eager)) if not torch.equal(s, e)]
    assert wrong, "FIA ran with capture-time lengths and nothing changed: the test sees no update"


# KV writers and sampling ----------------------------------------------------------------------


def _batch(dtype: torch.dtype, seed: int):
    """A mixed batch with two trailing padding rows over random caches."""
    host, gen = PagedHost(8, BLOCK_SIZE, seed=seed), torch.Generator().manual_seed(seed)
    host.step([(0, [1] * 129), (1, [1] * 40)])  # cached prefixes
    ids, pos, meta = host.step([(0, [2]), (1, [2] * 9), (2, [2] * 20)], pad_tokens=2)
    spec = AttentionSpec(8, 2, 128, dtype, BLOCK_SIZE)
    shape = (8, BLOCK_SIZE, 2, 128)
    caches = [LayerCache(*(torch.randn(shape, generator=gen).to(dtype) for _ in range(2)))]
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, 128, generator=gen).to(dtype) for h in (8, 2, 2))
    return spec, meta, caches, (q, k, v)


@pytest.mark.parametrize("writer", ["scatter_pa", "reshape_and_cache", "scatter_nd"])
def test_kv_writers_match_the_reference(npu, writer: str) -> None:
    from xhal.platforms.cpu_ref.attention import CpuAttention
    from xhal.platforms.npu.attention import NpuAttention

    spec, meta, caches, (q, k, v) = _batch(torch.bfloat16, seed=1)
    ref_caches = [LayerCache(c.key.clone(), c.value.clone()) for c in caches]
    backend = NpuAttention(
        spec, npu.torch_npu, npu.causal_mask(), npu.update_stream(), kv_writer=writer
    )
    backend.bind_kv_caches(caches)
    backend.plan(meta)
    out = backend.forward(0, q, k, v)
    reference = CpuAttention(spec)
    reference.bind_kv_caches(ref_caches)
    reference.plan(meta)
    expected = reference.forward(0, q, k, v)
    assert torch.equal(caches[0].key, ref_caches[0].key), f"{writer} wrote the keys wrong"
    assert torch.equal(caches[0].value, ref_caches[0].value), f"{writer} wrote the values wrong"
    real = int(meta.q_cu_seq_lens[-1])
    assert (out[:real].float() - expected[:real].float()).abs().max() < 2e-2


def test_hnd_cache_layout_matches_the_reference(npu, monkeypatch) -> None:
    """XHAL_NPU_KV_LAYOUT=HND: caches [nb, Hkv, bs, D] (FIA's recommended (blocknum, KV_N,
    blocksize, D)), written by scatter_nd at (block, head, offset) and read by FIA as they are;
    the same cache contents and outputs as the CPU reference on the NHD layout."""
    from xhal.platforms.cpu_ref.attention import CpuAttention

    assert "HND" in npu.capabilities.attention.kv_cache_layouts
    monkeypatch.setenv("XHAL_NPU_KV_LAYOUT", "HND")
    spec, meta, caches, (q, k, v) = _batch(torch.bfloat16, seed=2)
    backend = npu.attention_backend(spec)
    assert backend.kv_layout == "HND" and backend.kv_writer == "scatter_nd_hnd"
    assert backend.kv_cache_shape(8) == (8, 2, BLOCK_SIZE, 128)
    hnd = [LayerCache(*(t.transpose(1, 2).contiguous() for t in (c.key, c.value))) for c in caches]
    backend.bind_kv_caches(hnd)
    backend.plan(meta)
    out = backend.forward(0, q, k, v)
    reference = CpuAttention(spec)
    reference.bind_kv_caches(caches)
    reference.plan(meta)
    expected = reference.forward(0, q, k, v)
    assert torch.equal(hnd[0].key.transpose(1, 2), caches[0].key)
    assert torch.equal(hnd[0].value.transpose(1, 2), caches[0].value)
    real = int(meta.q_cu_seq_lens[-1])
    assert (out[:real].float() - expected[:real].float()).abs().max() < 2e-2
    monkeypatch.setenv("XHAL_NPU_KV_LAYOUT", "HDN")
    with pytest.raises(ValueError, match="NHD .*or HND"):
        npu.attention_backend(spec)


def test_block_size_not_a_multiple_of_128_is_refused_up_front(npu) -> None:
    for block_size in (16, 64, 192, 640):
        with pytest.raises(ValueError, match=f"block_size {block_size} .*multiple of 128"):
            npu.attention_backend(AttentionSpec(8, 2, 128, torch.bfloat16, block_size))


@pytest.mark.parametrize("top_k", [5, 0], ids=["npu_top_k_top_p", "torch-fallback"])
def test_sampling_in_and_outside_the_top_k_range_of_the_op(npu, top_k: int) -> None:
    """V = 4096 > 1024: k = 5 goes through npu_top_k_top_p, k off (0 = V) through torch; both
    draw only from the top-k / top-p set."""
    rows, vocab = 256, 4096
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    row = logits[:1].expand(rows, vocab).contiguous()
    top_p = 0.6
    tokens = npu.ops.sample(
        row,
        torch.ones(rows),
        torch.full((rows,), top_k, dtype=torch.int32),
        torch.full((rows,), top_p),
        torch.Generator().manual_seed(1),
    )
    probs, order = row[0].softmax(-1).sort(descending=True)
    nucleus = order[: int(((probs.cumsum(0) - probs) < top_p).sum())]
    allowed = set((nucleus[:top_k] if top_k else nucleus).tolist())
    assert set(tokens.tolist()) <= allowed and len(set(tokens.tolist())) > 1
