"""The phase clock's table rows (``benchmarks/phase_clock._rows``) from a clock filled by hand:
each mark's median and latest, the latest program, its SM and the programs that shared it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.phase_clock import _rows  # noqa: E402


def test_each_mark_names_its_latest_program_and_that_programs_sm() -> None:
    # three clocked programs (rows 0, 2 and 5 of the clock), two marks, SMs in column 7;
    # program 5 never reaches the second mark (0 there)
    ns = 1000
    stamped = torch.zeros(3, 8, dtype=torch.int64)
    stamped[:, 0] = torch.tensor([10, 11, 12]) * ns
    stamped[:, 1] = torch.tensor([20, 25, 0]) * ns
    stamped[:, 7] = torch.tensor([4, 4, 9])
    rows = _rows(stamped, torch.tensor([0, 2, 5]), ("start", "done"))
    assert [r["mark"] for r in rows] == ["start", "done"]
    start, done = rows
    assert (start["latest us"], start["latest program"], start["its SM"]) == (2.0, 5, 9)
    assert start["programs on it"] == 1 and start["CTAs"] == 3
    assert (done["latest us"], done["latest program"], done["its SM"]) == (15.0, 2, 4)
    assert done["programs on it"] == 2 and done["CTAs"] == 2
