"""xhal-serve's observability (issue 18 item 6), in process: every metric of the vLLM mapping in
docs/serving.md is exported under its mapped name with vLLM's labels and the values the requests
imply; one log line per request, without the prompt unless asked; the periodic stats line."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from tests.support.paths import REPO
from tests.support.scripted_engine import ScriptedEngine, call
from tests.support.tiny_server import tiny_tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

MODEL = "tiny-model"
DOCS = REPO / "docs" / "serving.md"


def make_app(log_prompts: bool = False) -> Any:
    from serve_cli.api import ServerState, build_app

    tokenizer = tiny_tokenizer()
    state = ServerState(
        ScriptedEngine(), tokenizer, MODEL, max_model_len=64, vocab_size=len(tokenizer),
        block_size=16, num_kv_blocks=4, log_prompts=log_prompts,
    )  # fmt: skip
    return build_app(state)


def mapping() -> list[tuple[str, str, str]]:
    """(vLLM name, xhal name, type) of each row of the docs' metrics table."""
    rows = re.findall(
        r"^\| `(vllm:[a-z_]+)` \| `(xhal_[a-z_]+)` \| (\w+) \|", DOCS.read_text(), re.M
    )
    assert len(rows) >= 20, "the metrics table of docs/serving.md was not found"
    return rows


def parse(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """(type of each metric family, value of each sample by its full name with labels)."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return types, samples


def test_every_mapped_metric_is_exported_with_vllms_labels() -> None:
    app = make_app()
    assert (
        call(
            app, "POST", "/v1/completions", {"model": MODEL, "prompt": [5, 6], "max_tokens": 3}
        ).status_code
        == 200
    )
    types, samples = parse(call(app, "GET", "/metrics").text)
    labels = f'model_name="{MODEL}",engine="0"'
    for vllm, xhal, kind in mapping():
        base = vllm.removeprefix("vllm:")
        expected = f"xhal_{base}" + (
            "_total" if kind == "counter" and not base.endswith("_total") else ""
        )
        assert xhal == expected, f"{vllm} must map to {expected} (only the prefix changes)"
        assert types.get(xhal) == kind, (xhal, types.get(xhal))
        suffix = "_count" if kind == "histogram" else ""
        labelled = [n for n in samples if n.startswith(f"{xhal}{suffix}{{{labels}")]
        assert labelled, f"{xhal} has no sample labelled {labels}"
    for name in samples:
        assert labels in name, f"{name} lacks the model_name / engine labels"


def test_metric_values_follow_the_requests() -> None:
    app = make_app()
    for max_tokens in (3, 5):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": max_tokens}
        assert call(app, "POST", "/v1/completions", body).status_code == 200
    _, s = parse(call(app, "GET", "/metrics").text)
    lab = f'model_name="{MODEL}",engine="0"'
    assert s[f'xhal_request_success_total{{{lab},finished_reason="length"}}'] == 2
    assert s[f'xhal_request_success_total{{{lab},finished_reason="abort"}}'] == 0
    assert s[f"xhal_request_generation_tokens_sum{{{lab}}}"] == 8
    assert s[f"xhal_request_prompt_tokens_sum{{{lab}}}"] == 6
    assert s[f"xhal_request_params_max_tokens_sum{{{lab}}}"] == 8
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "time_to_first_token_seconds"):  # fmt: skip
        assert s[f"xhal_{name}_count{{{lab}}}"] == 2, name
    assert s[f"xhal_inter_token_latency_seconds_count{{{lab}}}"] == (3 - 1) + (5 - 1)
    # the engine's figures (ScriptedEngine.stats) pass through: usage is a fraction, 1 of 4 blocks
    assert s[f"xhal_kv_cache_usage_perc{{{lab}}}"] == 0.25
    assert s[f"xhal_num_requests_running{{{lab}}}"] == 2
    assert s[f"xhal_iteration_tokens_total_count{{{lab}}}"] == 3
    assert s[f'xhal_iteration_tokens_total_bucket{{{lab},le="8.0"}}'] == 1
    assert s[f'xhal_iteration_tokens_total_bucket{{{lab},le="+Inf"}}'] == 3
    assert s[f"xhal_iteration_tokens_total_sum{{{lab}}}"] == 50


@pytest.mark.parametrize("log_prompts", [False, True], ids=["default", "log-prompts"])
def test_one_log_line_per_request(caplog: pytest.LogCaptureFixture, log_prompts: bool) -> None:
    app = make_app(log_prompts)
    with caplog.at_level(logging.INFO, logger="xhal.serve.requests"):
        response = call(app, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": "Why is the sky", "max_tokens": 4})  # fmt: skip
    assert response.status_code == 200, response.text
    reply = response.json()
    lines = [r.getMessage() for r in caplog.records if r.name == "xhal.serve.requests"]
    assert len(lines) == 1, lines
    (line,) = lines
    usage = reply["usage"]
    assert line.startswith(f"request {reply['id']}: ")
    assert f"prompt_tokens={usage['prompt_tokens']} output_tokens=4 finish_reason=length" in line
    assert re.search(r"latency=\d+\.\d{3}s ttft=\d+\.\d{3}s", line), line
    assert ("Why is the sky" in line) == log_prompts


def test_stats_line_reports_the_interval() -> None:
    from serve_cli.engine.stats_logger import StatsLogger

    now = [100.0]
    logger = StatsLogger(10.0, clock=lambda: now[0])
    stats = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "kv_blocks_total": 8,
             "kv_blocks_used": 0, "num_running": 0, "num_waiting": 0,
             "prefix_cache_queries": 0, "prefix_cache_hits": 0}  # fmt: skip
    now[0] = 105.0
    assert logger.maybe_log(lambda: stats) is None  # not due yet
    now[0] = 110.0
    assert logger.maybe_log(lambda: stats) is None  # idle: nothing to say
    stats.update(prompt_tokens_total=300, generation_tokens_total=50, kv_blocks_used=2,
                 num_running=3, num_waiting=1, prefix_cache_queries=200,
                 prefix_cache_hits=50)  # fmt: skip
    now[0] = 120.0
    line = logger.maybe_log(lambda: stats)
    assert line == (
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    stats.update(num_running=0, num_waiting=0, kv_blocks_used=0)
    now[0] = 130.0
    assert logger.maybe_log(lambda: stats).startswith("Avg prompt throughput: 0.0")  # went idle
    now[0] = 140.0
    assert logger.maybe_log(lambda: stats) is None  # and stays quiet while idle
    assert StatsLogger(0.0, clock=lambda: now[0]).maybe_log(lambda: stats) is None  # off
