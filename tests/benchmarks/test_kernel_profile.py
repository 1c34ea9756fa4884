"""What each kernel adds to a step's critical path (``benchmarks/kernel_profile.py``), on made-up
spans: the profile's events need a GPU, the arithmetic does not."""

from __future__ import annotations

from benchmarks.kernel_profile import critical_path


def test_critical_path_splits_overlapping_kernels_by_what_each_adds() -> None:
    # a: 0-10; b launched early (PDL) at 4, ends 15: adds 5, overlaps 6; c inside b: adds 0;
    # an idle gap of 5; d alone: adds its whole span
    events = [("b", 4.0, 15.0), ("a", 0.0, 10.0), ("c", 5.0, 12.0), ("d", 20.0, 23.0)]
    parts, idle = critical_path(events)
    assert parts == {
        "a": [1, 10.0, 0.0], "b after a": [1, 5.0, 6.0], "c after b": [1, 0.0, 7.0],
        "d after c": [1, 3.0, 0.0],
    }  # fmt: skip
    assert idle == 5.0
    assert sum(p[1] for p in parts.values()) + idle == 23.0  # the span from first start to last end
