"""A Prometheus-style histogram as plain data (cumulative buckets, sum, count), shared by the
engine (iteration sizes, sent over ZMQ as a dict) and the API process (latencies, token counts)."""

from __future__ import annotations

import bisect
from typing import Any


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": self.buckets, "counts": list(self.counts), "sum": self.sum,
                "count": self.count}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Histogram:
        histogram = cls(tuple(data["buckets"]))
        histogram.counts, histogram.sum, histogram.count = (
            list(data["counts"]), data["sum"], data["count"]
        )  # fmt: skip
        return histogram

    def samples(self, name: str, labels: str) -> list[str]:
        """The exposition lines; ``labels`` is ``'a="x",b="y"'`` (every sample's labels)."""
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]
        return lines


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10
