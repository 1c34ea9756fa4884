"""``GET /metrics`` in the Prometheus text format (version 0.0.4), without a client library.

Names and labels follow vLLM's (``docs/serving.md`` has the table) with the prefix ``xhal_`` for
``vllm:``, so a vLLM dashboard works once the prefix is changed: every sample carries
``model_name`` and ``engine``; finished requests count under ``finished_reason``. Engine gauges,
token counters and the iteration-size histogram come from ``EngineCore.stats()`` at scrape time;
request latencies are measured here, in the API process, from the request's arrival, with the
time the engine first scheduled it (``Output.scheduled_at``) splitting queue from prefill.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from serve_cli.histogram import Histogram, one_two_five

if TYPE_CHECKING:
    from serve_cli.api.choice import Choice

PREFIX = "xhal"
FINISH_REASONS = ("stop", "length", "abort", "error")  # every one is shown, 0 until it happens
# vLLM's buckets, so that its dashboards' quantiles mean the same here
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)

# (name, help, buckets kind) of the histograms measured here
_REQUEST_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time to first token.", "ttft"),
    ("inter_token_latency_seconds", "Time between successive output tokens.", "token"),
    ("time_per_output_token_seconds", "Time per output token (vLLM's older name of the "
     "inter-token latency).", "token"),
    ("request_time_per_output_token_seconds", "Mean time per output token after the first, per "
     "request.", "token"),
    ("e2e_request_latency_seconds", "End-to-end request latency.", "request"),
    ("request_queue_time_seconds", "Time a request waited before it was first scheduled.",
     "request"),
    ("request_inference_time_seconds", "Time from first scheduled to finished.", "request"),
    ("request_prefill_time_seconds", "Time from first scheduled to the first token.", "request"),
    ("request_decode_time_seconds", "Time from the first token to the last.", "request"),
    ("request_prompt_tokens", "Prompt tokens per request.", "tokens"),
    ("request_generation_tokens", "Generated tokens per request.", "tokens"),
    ("request_params_n", "The n of each HTTP request.", "n"),
    ("request_params_max_tokens", "The max_tokens of each request.", "tokens"),
)  # fmt: skip


class ServerMetrics:
    """The API process's request histograms and per-finish-reason request counts."""

    def __init__(self, max_model_len: int = 2048) -> None:
        buckets = {
            "ttft": TTFT_BUCKETS,
            "token": TOKEN_LATENCY_BUCKETS,
            "request": REQUEST_LATENCY_BUCKETS,
            "tokens": one_two_five(max_model_len),
            "n": N_BUCKETS,
        }
        self.histograms = {name: Histogram(buckets[kind]) for name, _, kind in _REQUEST_HISTOGRAMS}
        self.finished: Counter[str] = Counter()

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def on_http_request(self, n: int, max_tokens: int) -> None:
        self.observe("request_params_n", n)
        self.observe("request_params_max_tokens", max_tokens)

    def on_token(self, choice: Choice, now: float) -> None:
        """A step's output with tokens reached ``choice`` at ``now``."""
        if choice.first_token is None:
            self.observe("time_to_first_token_seconds", now - choice.arrival)
        elif choice.last_token is not None:
            self.observe("inter_token_latency_seconds", now - choice.last_token)
            self.observe("time_per_output_token_seconds", now - choice.last_token)

    def on_finished(self, choice: Choice) -> None:
        """``choice`` ended (``finish_reason`` set, "abort" when its client left)."""
        now = time.monotonic()
        self.finished[choice.finish_reason or "abort"] += 1
        self.observe("e2e_request_latency_seconds", now - choice.arrival)
        self.observe("request_prompt_tokens", len(choice.prompt_token_ids))
        self.observe("request_generation_tokens", len(choice.token_ids))
        if choice.scheduled_at is not None:
            self.observe(
                "request_queue_time_seconds", max(0.0, choice.scheduled_at - choice.started)
            )
            self.observe("request_inference_time_seconds", now - choice.scheduled_at)
            if choice.first_token is not None:
                self.observe(
                    "request_prefill_time_seconds", choice.first_token - choice.scheduled_at
                )
        if choice.first_token is not None:
            self.observe("request_decode_time_seconds", now - choice.first_token)
            if len(choice.token_ids) > 1:
                per_token = (now - choice.first_token) / (len(choice.token_ids) - 1)
                self.observe("request_time_per_output_token_seconds", per_token)

    def render(self, stats: dict[str, Any], model_name: str) -> str:
        labels = f'model_name="{_escape(model_name)}",engine="0"'
        total, used = stats.get("kv_blocks_total", 0), stats.get("kv_blocks_used", 0)
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        lines: list[str] = []

        def sample(name: str, kind: str, help_text: str, value: float) -> None:
            full = f"{PREFIX}_{name}"
            lines.extend(
                [
                    f"# HELP {full} {help_text}",
                    f"# TYPE {full} {kind}",
                    f"{full}{{{labels}}} {value}",
                ]
            )

        # vLLM's gauges and counters
        sample(
            "num_requests_running",
            "gauge",
            "Requests in the running batch.",
            stats.get("num_running", 0),
        )
        sample(
            "num_requests_waiting", "gauge", "Requests waiting to run.", stats.get("num_waiting", 0)
        )
        sample(
            "kv_cache_usage_perc",
            "gauge",
            "KV cache usage (1 = every block in use).",
            used / total if total else 0.0,
        )
        sample(
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            queries,
        )
        sample(
            "prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", hits
        )
        sample(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens processed.",
            stats.get("prompt_tokens_total", 0),
        )
        sample(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            stats.get("generation_tokens_total", 0),
        )
        sample(
            "num_preemptions_total",
            "counter",
            "Requests preempted (KV dropped, recomputed later).",
            stats.get("num_preemptions_total", 0),
        )
        name = f"{PREFIX}_request_success_total"
        lines += [f"# HELP {name} Requests finished, by finish reason.", f"# TYPE {name} counter"]
        for reason in sorted(set(FINISH_REASONS) | self.finished.keys()):
            lines.append(f'{name}{{{labels},finished_reason="{reason}"}} {self.finished[reason]}')
        iteration = stats.get("iteration_tokens")
        if iteration is not None:
            name = f"{PREFIX}_iteration_tokens_total"
            lines += [f"# HELP {name} Tokens per engine step.", f"# TYPE {name} histogram"]
            lines += Histogram.from_dict(iteration).samples(name, labels)
        for short, help_text, _ in _REQUEST_HISTOGRAMS:
            name = f"{PREFIX}_{short}"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            lines += self.histograms[short].samples(name, labels)
        # xhal's own, beyond vLLM's
        sample("kv_blocks_total", "gauge", "KV cache blocks in all.", total)
        sample("kv_blocks_used", "gauge", "KV cache blocks held by requests.", used)
        sample(
            "kv_blocks_free",
            "gauge",
            "KV cache blocks free to allocate.",
            stats.get("kv_blocks_free", 0),
        )
        sample(
            "prefix_cache_hit_rate",
            "gauge",
            "Prefix-cache hits / queries.",
            hits / queries if queries else 0.0,
        )
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
