"""Async scheduling in EngineCore: with overlap on, results match overlap off (greedy outputs,
stop strings, EOS, max_tokens, aborts, preemption, no block leak); step N+1 really executes before
step N is read back; a failing launch fails only its own batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from serve_cli.engine.config import EngineConfig  # noqa: E402
from serve_cli.engine.core import EngineCore  # noqa: E402
from serve_cli.engine.offline import TextSession  # noqa: E402
from serve_cli.engine.sampling import SamplingParams  # noqa: E402

BASE = dict(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=128, num_kv_blocks=48)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model_dir: Path, overlap: bool, **overrides) -> EngineCore:
    config = EngineConfig(model_dir=model_dir, async_scheduling=overlap, **{**BASE, **overrides})
    assert config.schedules_async is overlap
    return EngineCore(config)


@pytest.fixture(scope="module")
def engines(llama_gqa_dir: Path) -> dict[bool, EngineCore]:
    return {overlap: _engine(llama_gqa_dir, overlap) for overlap in (False, True)}


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]],
         abort_after: dict[str, int] | None = None) -> dict[str, dict]:  # fmt: skip
    """Submit all, step until idle (aborting a request once it has ``abort_after[rid]`` tokens);
    per request: token ids, text, finish reason, usage count and logprobs. Outputs go through a
    ``TextSession``: text and stop strings as the API process makes them."""
    session = TextSession(engine)
    for rid, (prompt, params) in requests.items():
        session.add_request(rid, prompt, params)
    result = {rid: dict(ids=[], text="", reason=None, n=0, lp=[]) for rid in requests}
    while session.has_unfinished():
        for out in session.step():
            r = result[out.request_id]
            r["ids"] += out.new_token_ids
            r["text"] += out.new_text
            r["lp"] += out.logprobs or []
            r["reason"], r["n"] = out.finish_reason, out.num_output_tokens
        for rid, n in (abort_after or {}).items():
            if len(result[rid]["ids"]) >= n and result[rid]["reason"] is None:
                session.abort(rid)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert engine._in_flight is None and not engine.scheduler._outstanding
    return result


def test_config_default_is_off_on_the_cpu_and_on_elsewhere() -> None:
    assert EngineConfig().schedules_async is False
    assert EngineConfig(device="cuda").schedules_async is True
    assert EngineConfig(device="npu", tensor_parallel_size=2).schedules_async is True
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(device="cuda", async_scheduling="yes")


def _assert_same(on: dict[str, dict], off: dict[str, dict]) -> None:
    assert on.keys() == off.keys()
    for rid in on:
        a, b = on[rid], off[rid]
        for key in ("ids", "text", "reason", "n"):
            assert a[key] == b[key], (rid, key)
        assert [x.token_id for x in a["lp"]] == [x.token_id for x in b["lp"]]
        assert [x.logprob for x in a["lp"]] == pytest.approx([x.logprob for x in b["lp"]], abs=1e-4)


def test_greedy_outputs_match_with_eos_max_tokens_and_chunked_prefill(engines) -> None:
    prompts = _prompts([5, 17, 33, 70, 1, 90, 12, 40, 8, 61, 3, 26], seed=11)
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    plain = _run(engines[False], {f"p{i}": (p, greedy) for i, p in enumerate(prompts)})
    eos = plain["p2"]["ids"][5]  # a token some requests emit mid-stream
    requests = {}
    for i, p in enumerate(prompts):
        params = replace(greedy, max_tokens=3 + i % 12, ignore_eos=i % 3 == 0)
        if i == 5:
            params = replace(params, logprobs=3)
        if i == 7:
            params = replace(params, temperature=0.8, seed=42)  # seeded: batch-independent
        requests[f"r{i}"] = (p, params)
    runs = {}
    for overlap, engine in engines.items():
        engine.postprocessor.eos_token_ids = frozenset({eos})
        runs[overlap] = _run(engine, requests)
        engine.postprocessor.eos_token_ids = frozenset()
    _assert_same(runs[True], runs[False])
    reasons = [r["reason"] for r in runs[False].values()]
    assert "stop" in reasons and "length" in reasons


def test_decode_graphs_fed_on_the_host_match_eager(
    llama_gqa_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With decode graphs (the reference platform's), steady decode steps reach the executor as
    host tensors with their ids still where the step before sampled them (the executor's
    ``token_ids``, read in place), staged by the graph in one copy: greedy outputs equal a
    synchronous eager engine's on the same platform, over batches that grow, shrink and change
    order (requests of different lengths finish apart)."""
    monkeypatch.setenv("XHAL_SERVE_CPU_PLATFORM", "cpu")
    prompts = _prompts([7, 19, 3, 30, 11], seed=13)
    requests = {
        f"g{i}": (p, SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    }
    eager = _run(_engine(llama_gqa_dir, False, enforce_eager=True), requests)
    graphs = _engine(llama_gqa_dir, True, enforce_eager=False)
    decode = graphs.runner.executor.decode_graphs
    assert decode is not None
    in_place: list[bool] = []
    check = decode._ids_in_place

    def counted(ids: torch.Tensor) -> bool:
        in_place.append(check(ids))
        return in_place[-1]

    monkeypatch.setattr(decode, "_ids_in_place", counted)
    _assert_same(_run(graphs, requests), eager)
    assert any(in_place), "no decode step read its ids in place"
    assert any(("decode", b) in decode.graphs for b in decode.sizes), "no decode graph ran"


def test_stop_strings_cut_the_same_text(tmp_path_factory: pytest.TempPathFactory) -> None:
    from serve_cli.default_model import ensure_default_model

    model_dir = ensure_default_model(tmp_path_factory.mktemp("cache"))
    engines = {o: _engine(model_dir, o, num_kv_blocks=32, max_num_batched_tokens=24)
               for o in (False, True)}  # fmt: skip
    tok = engines[False].tokenizer
    texts = ["Where did you put the keys?", "Once upon a time", "The quick brown fox jumps",
             "Tell me a story about a dragon and a knight who", "1 2 3 4", "Hello"]  # fmt: skip
    prompts = [tok(t)["input_ids"] for t in texts]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = _run(engines[False], {f"p{i}": (p, greedy) for i, p in enumerate(prompts)})
    requests = {}
    for i, p in enumerate(prompts):
        text = plain[f"p{i}"]["text"]
        stop = text[len(text) // 3 :][:3]
        requests[f"s{i}"] = (p, replace(greedy, stop=(stop,) if stop.strip() else ()))
    runs = {overlap: _run(engine, requests) for overlap, engine in engines.items()}
    _assert_same(runs[True], runs[False])
    assert sum(r["reason"] == "stop" for r in runs[False].values()) >= 3


def test_aborts_mid_stream_free_everything_and_leave_the_others_unchanged(engines) -> None:
    prompts = _prompts([9, 30, 14, 52, 6, 21], seed=12)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    requests = {f"a{i}": (p, params) for i, p in enumerate(prompts)}
    full = _run(engines[False], requests)
    cut = {"a1": 3, "a4": 1, "a5": 8}
    for overlap, engine in engines.items():
        got = _run(engine, requests, abort_after=cut)
        for rid, r in got.items():
            if rid in cut:
                assert r["reason"] == "abort" and len(r["ids"]) >= cut[rid]
                assert r["ids"] == full[rid]["ids"][: len(r["ids"])]
            else:
                assert r["ids"] == full[rid]["ids"] and r["reason"] == "length", (overlap, rid)


def test_preemption_under_a_tiny_kv_budget_matches(llama_gqa_dir: Path) -> None:
    prompts = _prompts([30, 28, 25, 33, 20, 31, 17], seed=13)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    requests = {f"q{i}": (p, params) for i, p in enumerate(prompts)}
    runs = {}
    for overlap in (False, True):
        engine = _engine(llama_gqa_dir, overlap, num_kv_blocks=8)
        runs[overlap] = _run(engine, requests)
        assert engine.stats()["num_preemptions_total"] > 0
        assert engine.stats()["kv_blocks_free"] == 8
    assert {k: v["ids"] for k, v in runs[True].items()} == {
        k: v["ids"] for k, v in runs[False].items()
    }


def test_step_n_plus_1_executes_before_step_n_is_read_back(engines, monkeypatch) -> None:
    """An instrumented runner: the log shows each step's execute and the read-back of its tokens;
    with overlap, step k+1's execute (fed by placeholders) comes before step k's read-back."""
    prompts = _prompts([7, 19, 40], seed=14)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    logs = {}
    for overlap, engine in engines.items():
        runner, log = engine.runner, []
        launch, collect, execute = runner.launch, runner.collect, runner.executor.execute
        upload = runner.input_builder.upload
        ids: dict[int, int] = {}

        def traced_execute(*args, _execute=execute, _log=log, **kwargs):
            _log.append(("execute", sum(1 for e in _log if e[0] == "execute")))
            return _execute(*args, **kwargs)

        def traced_launch(*args, _launch=launch, _log=log, _ids=ids, **kwargs):
            launched = _launch(*args, **kwargs)
            _ids[id(launched)] = sum(1 for e in _log if e[0] == "execute") - 1
            return launched

        def traced_collect(launched, _collect=collect, _log=log, _ids=ids):
            _log.append(("read", _ids[id(launched)]))
            return _collect(launched)

        def traced_upload(step, previous=None, _upload=upload, _log=log):
            _log.append(("placeholders", len(step.placeholder_idxes)))
            return _upload(step, previous)

        monkeypatch.setattr(runner.executor, "execute", traced_execute)
        monkeypatch.setattr(runner, "launch", traced_launch)
        monkeypatch.setattr(runner, "collect", traced_collect)
        monkeypatch.setattr(runner.input_builder, "upload", traced_upload)
        out = _run(engine, {f"t{i}": (p, params) for i, p in enumerate(prompts)})
        logs[overlap] = (log, out)
    (off_log, off), (on_log, on) = logs[False], logs[True]
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}

    def order(log: list) -> list[tuple[int, int]]:
        """(index of step k's read-back, index of step k+1's execute) in the log, per k."""
        at = {e: i for i, e in enumerate(log)}
        n = sum(1 for e in log if e[0] == "execute")
        return [(at[("read", k)], at[("execute", k + 1)]) for k in range(n - 1)]

    assert all(read < nxt for read, nxt in order(off_log))  # plain: read back, then next step
    assert all(nxt < read for read, nxt in order(on_log))  # overlap: next step first
    assert sum(n for kind, n in on_log if kind == "placeholders") > 0
    assert sum(n for kind, n in off_log if kind == "placeholders") == 0


def test_a_failing_launch_fails_its_batch_after_the_step_before_is_read(
    llama_gqa_dir: Path, fail_first_call
) -> None:
    engine = _engine(llama_gqa_dir, True, max_num_seqs=2)
    a, b, c = _prompts([20, 7, 13], seed=15)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for rid, prompt in zip("abc", (a, b, c)):
        engine.add_request(rid, prompt, params)
    assert engine.step() == []  # a and b prefill, in flight; c waits (max_num_seqs=2)
    fail_first_call(engine.runner.executor, "execute")
    outputs = engine.step()  # the prefill's tokens, then the failed decode's errors
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("a", None), ("b", None), ("a", "error"), ("b", "error")
    ]
    assert "injected device fault" in outputs[-1].error
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_waiting"] == 1
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "c" and out.finish_reason in (None, "length")
            got += out.new_token_ids
    expected = _run(_engine(llama_gqa_dir, False), {"c": (c, params)})["c"]["ids"]
    assert got == expected and engine.stats()["kv_blocks_used"] == 0
