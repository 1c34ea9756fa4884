"""TEST-ONLY plugin: a CPU ``linear`` solution with a two-point config space ("heavy" repeats
the matmul 30 times, "light" once), above the reference so it is chosen, for ``xhal-tune``."""

from __future__ import annotations

from xhal import solutions
from xhal.solutions.solution import Config

solutions.register(
    solutions.Solution(
        "linear",
        "tunable",
        "tests.support.toy_solutions:TunableLinear",
        solutions.Requirement(device_type="cpu"),
        priority=10,
        bucket="tests.support.toy_solutions:rows_bucket",
        configs=(
            Config("heavy", {"cost": 0.0, "work": 30}),
            Config("light", {"cost": 0.0, "work": 1}),
        ),
    )
)
