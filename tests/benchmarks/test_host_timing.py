"""benchmarks/host_timing.py's call wrappers: exclusive times add up, and the originals come
back."""

from __future__ import annotations

import pytest

from benchmarks.host_timing import timing


class FakeTime:
    """Stands in for the ``time`` module that host_timing reads: a clock the calls below advance
    by exact amounts, so the sums are exact however loaded the machine is."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class Clock:
    def outer(self) -> str:
        FakeTime.now += 0.002
        return self.inner()

    def inner(self) -> str:
        FakeTime.now += 0.004
        return "done"


def test_nested_calls_count_exclusive_time_and_are_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import benchmarks.host_timing

    monkeypatch.setattr(benchmarks.host_timing, "time", FakeTime)
    outer, inner = Clock.outer, Clock.inner
    totals: dict[str, float] = {}
    with timing(totals, [(Clock, "outer", "outer"), (Clock, "inner", "inner")]):
        assert Clock().outer() == "done"
    assert Clock.outer is outer and Clock.inner is inner
    assert totals["inner"] == pytest.approx(0.004)
    assert totals["outer"] == pytest.approx(0.002), "outer must exclude the inner call's time"


def test_a_raising_call_still_counts_and_is_restored() -> None:
    class Boom:
        def go(self) -> None:
            raise ValueError("boom")

    go, totals = Boom.go, {}
    with timing(totals, [(Boom, "go", "go")]):
        try:
            Boom().go()
        except ValueError:
            pass
    assert Boom.go is go and totals["go"] >= 0.0


def test_every_timed_call_of_a_graph_step_exists() -> None:
    """The breakdown names calls of xhal's own classes: a rename must fail here, not on the GPU."""
    from benchmarks.host_timing import _timed_calls

    missing = [label for owner, name, label in _timed_calls() if not hasattr(owner, name)]
    assert not missing, missing


@pytest.mark.parametrize("route, pairs", [("host", 1), ("device", 5)])
def test_the_emulated_host_benchmark_runs_and_counts_a_steady_steps_copies(
    route: str, pairs: int
) -> None:
    """A step handed on the host crosses in its one pinned copy; one on the device in one
    multi-tensor copy of five pairs (ids, positions, slots, KV lengths, table: the width only
    when it changed); a step that crosses a page also re-plans, so it makes more tensor ops."""
    from benchmarks.bench_host_emulated import measure

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 256,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "architectures": ["LlamaForCausalLM"]}  # fmt: skip
    row = measure(2, 64, route, steps=20, shape=tiny)
    assert row["route"] == route and row["copy_pairs"] == pairs
    assert 1 <= row["tensor_ops"] < row["ops_max"]  # 20 steps from 65 tokens cross a page
    assert 0 < row["plan_us"] and 0 < row["execute_us"]


def test_enter_inflight_queues_the_step_after_the_synchronize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import benchmarks.host_timing
    from benchmarks.host_timing import enter

    calls: list[str] = []
    monkeypatch.setattr(
        benchmarks.host_timing.torch.cuda, "synchronize", lambda: calls.append("synchronize")
    )
    enter("inflight", lambda: calls.append("step"))
    assert calls == ["synchronize", "step"]
    with pytest.raises(ValueError, match="needs the step"):
        enter("inflight")
    with pytest.raises(ValueError, match="unknown entry mode 'queued'"):
        enter("queued")


def test_device_calls_count_the_pairs_copies_move() -> None:
    import torch

    from benchmarks.host_timing import DeviceCalls

    dst, src = [torch.zeros(2) for _ in range(3)], [torch.ones(2) for _ in range(3)]
    with DeviceCalls() as calls:
        torch._foreach_copy_(dst, src)
        dst[0].copy_(src[1])
        dst[1][:1].add_(1)
    assert calls.copies == 4  # three pairs, then one
    assert len(calls.ops) == 3


def test_baseline_graphs_load_with_their_own_tree_beside(tmp_path) -> None:
    """An earlier tree's decode graphs import that tree's ``staged_table``, not this one's, and
    this tree's module is back in place afterwards."""
    import sys

    import xhal.executor.staged_table as ours
    from benchmarks.host_timing import baseline_graphs

    executor = tmp_path / "xhal" / "executor"
    executor.mkdir(parents=True)
    (executor / "staged_table.py").write_text("TREE = 'earlier'\n")
    (executor / "decode_graph.py").write_text(
        "from xhal.executor.staged_table import TREE\n\n\nclass DecodeGraphs:\n    tree = TREE\n"
    )
    assert baseline_graphs(tmp_path).tree == "earlier"
    assert sys.modules["xhal.executor.staged_table"] is ours
    with pytest.raises(SystemExit, match="does not exist"):
        baseline_graphs(tmp_path / "missing")
