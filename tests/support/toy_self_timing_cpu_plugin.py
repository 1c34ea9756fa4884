"""TEST-ONLY plugin: a CPU ``linear`` solution that times its own choices (``times_itself``),
above the reference so it is chosen, for ``xhal-tune``."""

from __future__ import annotations

from xhal import solutions

solutions.register(
    solutions.Solution(
        "linear",
        "self-timing",
        "tests.support.toy_solutions:SelfTimingLinear",
        solutions.Requirement(device_type="cpu"),
        priority=10,
        times_itself=True,
    )
)
