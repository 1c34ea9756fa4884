"""The engine's periodic stats line, like vLLM's: throughput over the last interval, running and
waiting requests, KV cache usage and the prefix-cache hit rate. Quiet while the engine stays
idle (one line when it becomes idle, then none until work arrives)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("xhal.serve.engine")


class StatsLogger:
    """``maybe_log(stats_fn)`` logs at most once per ``interval`` seconds (0 turns it off);
    ``stats_fn`` is ``EngineCore.stats`` and is called only when a line is due."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self.last_time = clock()
        self.last: dict[str, Any] = {}
        self.was_idle = True

    def maybe_log(self, stats_fn: Callable[[], dict[str, Any]]) -> str | None:
        """The line logged, or None when none was due or the engine stayed idle."""
        now = self.clock()
        if self.interval <= 0 or now - self.last_time < self.interval:
            return None
        stats, elapsed = stats_fn(), now - self.last_time
        delta = {k: stats.get(k, 0) - self.last.get(k, 0) for k in _COUNTERS}
        self.last_time, self.last = now, {k: stats.get(k, 0) for k in _COUNTERS}
        idle = (
            not any(delta.values())
            and not stats.get("num_running")
            and not stats.get("num_waiting")
        )
        if idle and self.was_idle:
            return None
        self.was_idle = idle
        total = stats.get("kv_blocks_total", 0)
        usage = stats.get("kv_blocks_used", 0) / total if total else 0.0
        queries = delta["prefix_cache_queries"]
        hit_rate = delta["prefix_cache_hits"] / queries if queries else 0.0
        prompt_rate = delta["prompt_tokens_total"] / elapsed
        generation_rate = delta["generation_tokens_total"] / elapsed
        line = (
            f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
            f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
            f"Running: {stats.get('num_running', 0)} reqs, Waiting: {stats.get('num_waiting', 0)} "
            f"reqs, KV cache usage: {usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}"
        )
        logger.info(line)
        return line


_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries",
             "prefix_cache_hits")  # fmt: skip
