"""benchmarks/host_timing.py's call wrappers: exclusive times add up, and the originals come back."""

from __future__ import annotations

import time

from benchmarks.host_timing import timing


class Clock:
    def outer(self) -> str:
        time.sleep(0.002)
        return self.inner()

    def inner(self) -> str:
        time.sleep(0.004)
        return "done"


def test_nested_calls_count_exclusive_time_and_are_restored() -> None:
    outer, inner = Clock.outer, Clock.inner
    totals: dict[str, float] = {}
    with timing(totals, [(Clock, "outer", "outer"), (Clock, "inner", "inner")]):
        assert Clock().outer() == "done"
    assert Clock.outer is outer and Clock.inner is inner
    assert 0.004 <= totals["inner"] < 0.020
    assert 0.002 <= totals["outer"] < 0.004 + 0.010, "outer must exclude the inner call's time"


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
