"""EngineCore end to end on tiny random checkpoints: greedy output against a plain offline loop over
the executor (and transformers), preemption, prefix caching, stop strings, seeds, faults, aborts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.config import EngineConfig
from serve_cli.engine.core import EngineCore
from serve_cli.engine.errors import ParamError
from serve_cli.engine.offline import TextSession, generate
from serve_cli.engine.request import Request
from serve_cli.engine.runner.input_builder import InputBuilder
from serve_cli.engine.sampling import SamplingParams
from serve_cli.engine.scheduler import Scheduler
from tests.support.engine_runs import GREEDY, SMALL, drain, random_prompts, small_engine

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def default_engine(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    from serve_cli.default_model import ensure_default_model

    return small_engine(ensure_default_model(tmp_path_factory.mktemp("cache")), num_kv_blocks=32)


def test_greedy_matches_offline_executor_loop(engine: EngineCore, reference) -> None:
    # 70 and 90 tokens exceed the 64-token step budget: chunked prefill next to decodes
    prompts = random_prompts([5, 17, 33, 70, 1, 90])
    assert generate(engine, prompts, GREEDY) == [reference(p) for p in prompts]
    assert engine.stats()["kv_blocks_used"] == 0


def test_executor_buckets_follow_the_servers_token_budget(engine: EngineCore) -> None:
    # the piecewise buckets and the warm-up prefill are sized by the executor's budget: it must
    # be the one the engine was started with (64 here), not ExecutorConfig's 2048 default
    config = engine.runner.executor.config
    assert config.max_num_batched_tokens == SMALL["max_num_batched_tokens"]
    assert max(config.token_capture_sizes) == SMALL["max_num_batched_tokens"]


def test_greedy_matches_transformers(llama_gqa_dir: Path, engine: EngineCore) -> None:
    import transformers

    prompt = random_prompts([23], seed=7)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_gqa_dir, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):  # greedy by hand: the whole sequence each time, no cache
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert generate(engine, [prompt], params) == [ids[len(prompt) :]]


def test_small_kv_budget_preempts_and_completes_everything(llama_gqa_dir: Path, reference) -> None:
    engine = small_engine(llama_gqa_dir, num_kv_blocks=8)  # 128 token slots for ~300 tokens of work
    prompts = random_prompts([30, 28, 25, 33, 20, 31], seed=1)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert generate(engine, prompts, params) == [reference(p, 20) for p in prompts]
    stats = engine.stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == 8


def test_repeated_long_prompt_hits_the_prefix_cache(engine: EngineCore, reference) -> None:
    prompt = random_prompts([75], seed=2)[0]
    before = engine.stats()
    runs = []
    for rid in ("first", "second"):
        engine.add_request(rid, prompt, GREEDY)
        runs.append(drain(engine)[rid])
    first, second = runs
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 64  # 4 full blocks of 16; the last token is computed
    stats = engine.stats()
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 64
    assert stats["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * 75
    tokens = [sum((o.new_token_ids for o in run), []) for run in runs]
    assert tokens[0] == tokens[1] == reference(prompt)


def test_stop_string_cuts_text_and_finishes_with_stop(default_engine: EngineCore) -> None:
    tok = default_engine.tokenizer
    prompt = tok("Where did you put the keys?")["input_ids"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    session = TextSession(default_engine)  # the text is made as the API process makes it
    session.add_request("free", prompt, params)
    run = drain(session)["free"]
    ids = sum((o.new_token_ids for o in run), [])
    text = "".join(o.new_text for o in run)
    assert text == tok.decode(ids, skip_special_tokens=True) and run[-1].finish_reason == "length"

    # a stop string that straddles the boundary of the 4th and 5th tokens
    k = len(tok.decode(ids[:4]))
    stop = text[k - 1 : k + 2]
    cut = text.find(stop)
    session.add_request("stopped", prompt, replace(params, stop=("@@@", stop)))
    run = drain(session)["stopped"]
    assert "".join(o.new_text for o in run) == text[:cut]
    assert run[-1].finished and run[-1].finish_reason == "stop"
    got = sum((o.new_token_ids for o in run), [])
    assert got == ids[: len(got)] and len(got) < len(ids)


def test_eos_finishes_with_stop_unless_ignored(llama_gqa_dir: Path, reference) -> None:
    engine = small_engine(llama_gqa_dir)
    prompt = random_prompts([12], seed=3)[0]
    expected = reference(prompt)
    k = next(i for i in range(1, len(expected)) if expected[i] not in expected[:i])
    engine.postprocessor.eos_token_ids = frozenset({expected[k]})  # a later greedy token is EOS
    engine.add_request("eos", prompt, SamplingParams(max_tokens=10, temperature=0))
    engine.add_request("ignore", prompt, GREEDY)
    outputs = drain(engine)
    eos = outputs["eos"]
    assert sum((o.new_token_ids for o in eos), []) == expected[: k + 1]  # the EOS included
    assert eos[-1].finish_reason == "stop" and eos[-1].num_output_tokens == k + 1
    assert sum((o.new_token_ids for o in outputs["ignore"]), []) == expected
    assert outputs["ignore"][-1].finish_reason == "length"


def test_stop_token_ids_finish_after_the_token_even_ignoring_eos(
    llama_gqa_dir: Path, reference
) -> None:
    engine = small_engine(llama_gqa_dir)
    prompt = random_prompts([12], seed=3)[0]
    expected = reference(prompt)
    k = next(i for i in range(1, len(expected)) if expected[i] not in expected[:i])
    engine.add_request("stop", prompt, replace(GREEDY, stop_token_ids=(expected[k], 10**6)))
    engine.add_request("plain", prompt, GREEDY)
    outputs = drain(engine)
    stop = outputs["stop"]
    assert sum((o.new_token_ids for o in stop), []) == expected[: k + 1]  # the stop token included
    assert stop[-1].finish_reason == "stop"
    assert sum((o.new_token_ids for o in outputs["plain"]), []) == expected


def test_seeded_sampling_is_reproducible_in_any_batch(engine: EngineCore) -> None:
    prompt = random_prompts([15], seed=4)[0]
    seeded = SamplingParams(
        max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True
    )
    alone = generate(engine, [prompt], seeded)[0]
    others = random_prompts([9, 40], seed=5)
    unseeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    mixed = generate(engine, [*others, prompt], [unseeded, unseeded, seeded])
    assert mixed[2] == alone
    assert generate(engine, [prompt], replace(seeded, seed=99))[0] != alone
    assert generate(engine, [prompt], seeded)[0] == alone


def test_logprobs_are_log_softmax_of_the_logits(engine: EngineCore, llama_gqa_dir: Path) -> None:
    from models import load_model
    from xhal.tools.align import xhal_prefill

    prompt = random_prompts([11], seed=6)[0]
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=4, ignore_eos=True)
    engine.add_request("lp", prompt, params)
    run = drain(engine)["lp"]
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in run)
    first = run[0].logprobs[0]
    model = load_model(llama_gqa_dir, progress=False)
    _, logits = xhal_prefill(model, torch.tensor(prompt, dtype=torch.int32))
    expected = torch.log_softmax(logits[-1].double(), -1)
    assert first.token_id == int(expected.argmax()) == run[0].new_token_ids[0]
    assert first.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    top_ids = expected.topk(4).indices.tolist()
    assert [t for t, _ in first.top] == top_ids
    assert [lp for _, lp in first.top] == pytest.approx(expected[top_ids].tolist(), abs=1e-4)


def test_failing_step_fails_only_its_batch(llama_gqa_dir: Path, reference, fail_first_call) -> None:
    engine = small_engine(llama_gqa_dir, max_num_seqs=2)
    a, b, c = random_prompts([20, 7, 13], seed=8)
    for rid, prompt in zip("abc", (a, b, c)):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()  # a and b prefilled, holding blocks; c waits (max_num_seqs=2)
    fail_first_call(engine.runner.executor, "execute")
    outputs = engine.step()
    assert {o.request_id: o.finish_reason for o in outputs} == {"a": "error", "b": "error"}
    assert all("injected device fault" in o.error for o in outputs)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_waiting"] == 1
    rest = drain(engine)
    assert list(rest) == ["c"] and sum((o.new_token_ids for o in rest["c"]), []) == reference(c)
    assert generate(engine, [a], GREEDY) == [reference(a)]  # and the next request works


def test_abort_frees_blocks(engine: EngineCore) -> None:
    params = SamplingParams(max_tokens=100, temperature=0)
    engine.add_request("long", random_prompts([40], seed=9)[0], params)
    for _ in range(3):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort("long") and not engine.abort("long") and not engine.abort("unknown")
    assert engine.stats()["kv_blocks_used"] == 0
    (out,) = engine.step()
    assert (out.request_id, out.finished, out.finish_reason) == ("long", True, "abort")
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "field, prompt, params",
    [
        ("max_tokens", [5], {"max_tokens": 0}),
        ("temperature", [5], {"temperature": -0.5}),
        ("top_p", [5], {"top_p": 0.0}),
        ("top_p", [5], {"top_p": 1.5}),
        ("top_k", [5], {"top_k": -2}),
        ("stop", [5], {"stop": ("ok", 3)}),
        ("stop", [5], {"stop": "ok"}),  # a tuple of strings, not a bare string
        ("logprobs", [5], {"logprobs": 21}),
        ("seed", [5], {"seed": 1.5}),
        ("stop_token_ids", [5], {"stop_token_ids": [3]}),
        ("prompt", [], {}),
        ("prompt", [5] * 129, {}),
        ("prompt", [5, 256], {}),
        ("prompt", [5, 2.0], {}),
    ],
)
def test_bad_requests_name_the_field(engine: EngineCore, field, prompt, params) -> None:
    """Sampling parameters are checked where they are made (one place), the prompt on arrival."""
    with pytest.raises(ParamError, match=field) as err:
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert err.value.param == field and isinstance(err.value, ValueError)
    assert not engine.has_unfinished()


def test_duplicate_id_and_unsupported_config_are_refused(engine: EngineCore, llama_gqa_dir) -> None:
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", [5, 6], GREEDY)
    engine.abort("dup")
    engine.step()
    # tensor_parallel_size=2 runs now (tests/serve/test_serve_tp.py); a size below 1 is refused
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model_dir=llama_gqa_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="max_model_len"):
        small_engine(llama_gqa_dir, max_model_len=512)  # the checkpoint has 256 positions


@pytest.mark.parametrize("convention", ["cuda", "npu"])
def test_input_builder_emits_the_xllm_layout(convention: str) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64)
    for rid, n in (("a", 3), ("b", 10)):
        scheduler.submit(Request(rid, list(range(1, n + 1)), max_tokens=4))
    builder = InputBuilder(torch.device("cpu"), convention, block_size=4)

    batch = scheduler.next_batch()  # a: its whole prompt; b: a 9-token chunk that samples nothing
    inputs = builder.build(batch)
    assert inputs.sampled_request_ids == ["a"] and inputs.selected_idxes.tolist() == [2]
    assert inputs.metadata.kind.name == "PREFILL" and inputs.metadata.num_tokens == 12
    assert (inputs.metadata.paged_kv_indptr is not None) == (convention == "cuda")
    scheduler.advance(batch, {"a": 7})

    batch = scheduler.next_batch()  # a: a decode; b: its last prompt token
    inputs = builder.build(batch)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [7, 10] and inputs.positions.tolist() == [3, 9]
    assert md.q_seq_lens.tolist() == [1, 1] and md.kv_seq_lens.tolist() == [4, 10]
    assert md.q_cu_seq_lens.tolist() == [0, 1, 2] and md.kv_cu_seq_lens.tolist() == [0, 4, 14]
    a, b = batch.requests
    assert md.block_table.tolist() == [a.block_table + [0, 0], b.block_table]
    assert md.slot_mapping.tolist() == a.slot_mapping + b.slot_mapping
    assert inputs.selected_idxes.tolist() == [0, 1] and inputs.sampled_request_ids == ["a", "b"]
    # a decode step is handed on as host tensors (the executor stages it), without paged-KV
    # arrays: a decode graph stages none and an eager decode plans from the host lengths
    assert md.slot_mapping.is_cpu and md.paged_kv_indptr is None

