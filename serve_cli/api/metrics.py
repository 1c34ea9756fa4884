"""``GET /metrics`` in the Prometheus text format (version 0.0.4), without a client library.

Engine gauges and token counters come from ``EngineCore.stats()`` at scrape time; latencies are
measured here, in the API process, as the client sees them: TTFT from the request's arrival to
its first token, time per output token over the rest of the request.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_cli.api.generation import Choice

PREFIX = "xhal"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Latency histograms and per-finish-reason request counts of one server."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Time per output token after the first.",
            TPOT_BUCKETS,
        )
        self.finished: Counter[str] = Counter()

    def on_first_token(self, choice: Choice) -> None:
        assert choice.first_token is not None
        self.ttft.observe(choice.first_token - choice.started)

    def on_finished(self, choice: Choice) -> None:
        self.finished[choice.finish_reason or "unknown"] += 1
        if choice.first_token is not None and len(choice.token_ids) > 1:
            per_token = (time.monotonic() - choice.first_token) / (len(choice.token_ids) - 1)
            self.tpot.observe(per_token)

    def render(self, stats: dict[str, Any]) -> str:
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        lines: list[str] = []
        for name, kind, help_text, value in (
            ("num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
            ("num_requests_waiting", "gauge", "Requests waiting to run.", "num_waiting"),
            ("kv_blocks_total", "gauge", "KV cache blocks in all.", "kv_blocks_total"),
            ("kv_blocks_used", "gauge", "KV cache blocks held by requests.", "kv_blocks_used"),
            ("kv_blocks_free", "gauge", "KV cache blocks free to allocate.", "kv_blocks_free"),
            (
                "prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                "prefix_cache_queries",
            ),
            (
                "prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                "prefix_cache_hits",
            ),
            ("prompt_tokens_total", "counter", "Prompt tokens processed.", "prompt_tokens_total"),
            ("generation_tokens_total", "counter", "Tokens generated.", "generation_tokens_total"),
            (
                "num_preemptions_total",
                "counter",
                "Requests preempted (KV dropped, recomputed later) for lack of KV blocks.",
                "num_preemptions_total",
            ),
        ):
            lines += _sample(name, kind, help_text, stats.get(value, 0))
        hit_rate = hits / queries if queries else 0.0
        lines += _sample("prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries.", hit_rate)
        name = f"{PREFIX}_requests_finished_total"
        lines += [f"# HELP {name} Requests finished, by reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
        lines += self.ttft.render() + self.tpot.render()
        return "\n".join(lines) + "\n"


def _sample(name: str, kind: str, help_text: str, value: float) -> list[str]:
    full = f"{PREFIX}_{name}"
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full} {value}"]
