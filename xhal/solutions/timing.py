"""Device-neutral timing of a callable: the platform's ``synchronize`` around a host clock."""

from __future__ import annotations

import time
from collections.abc import Callable


class Timer:
    """``measure(fn)``: mean seconds per call over ``repeats`` calls after ``warmup`` calls, the
    device drained before the clock starts and before it stops (queued work counts). The clock
    is injectable so selection logic can be tested with a fake one."""

    def __init__(
        self,
        synchronize: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
        warmup: int = 2,
        repeats: int = 10,
    ) -> None:
        if warmup < 0 or repeats < 1:
            raise ValueError(f"Timer needs warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
        self.synchronize, self.clock = synchronize, clock
        self.warmup, self.repeats = warmup, repeats

    def measure(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):  # compiles and caches kernels outside the timed calls
            fn()
        self.synchronize()
        start = self.clock()
        for _ in range(self.repeats):
            fn()
        self.synchronize()
        return (self.clock() - start) / self.repeats
