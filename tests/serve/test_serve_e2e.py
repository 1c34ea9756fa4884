"""xhal-serve end to end on a tiny checkpoint made here: greedy output equals the offline engine's,
concurrency, prefix caching, disconnects, a KV cache too small for the load and clean shutdown,
all against the real ``xhal-serve`` process driven by the ``openai`` client (engine death and
shutdown under load: test_serve_shutdown.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from serve_cli.engine.offline import generate
from tests.support.checkpoints import llama_gqa
from tests.support.launcher import ServerProcess
from tests.support.processes import GENEROUS_S, spawned_children, wait_for, wait_gone

openai = pytest.importorskip("openai", reason="the server tests drive it with the openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")


MAX_MODEL_LEN = 256
API_KEY = "sk-e2e"  # every server here requires it (the tests send it everywhere)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
ABORTED = 'xhal_request_success_total{finished_reason="abort"}'
WORDS = "the quick brown fox jumps over a lazy dog hello world one two three four five".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GQA Llama of tests/support/checkpoints.py with its word-level tokenizer and a chat
    template."""
    from transformers import AutoTokenizer

    path = llama_gqa(tmp_path_factory.mktemp("serve-llama"), tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def serve_args(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--api-key",
        API_KEY,
        "--log-level",
        "warning",
        *extra,
    ]


@pytest.fixture(scope="module")
def server(model_dir: Path):
    with ServerProcess(serve_args(model_dir, "--num-kv-blocks", "256")) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_kv_server(model_dir: Path):
    """Eight blocks of 4 tokens: room for two of the requests below at a time, not six."""
    args = serve_args(model_dir, "--num-kv-blocks", "8", "--block-size", "4", "--max-num-seqs", "8")
    with ServerProcess(args) as srv:
        yield srv


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def prompts(num: int, length: int, seed: int = 0) -> list[str]:
    return [
        " ".join(WORDS[(seed + i * 7 + j * (i + 3)) % len(WORDS)] for j in range(length))
        for i in range(num)
    ]


def greedy(server: ServerProcess, texts: list[str], max_tokens: int) -> list[list[int]]:
    out = client(server).completions.create(
        model="tiny",
        prompt=texts,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]


def assert_all_blocks_free(server: ServerProcess) -> dict[str, float]:
    samples = server.metrics()
    assert samples["xhal_num_requests_running"] == samples["xhal_num_requests_waiting"] == 0
    assert samples["xhal_kv_blocks_used"] == 0
    assert samples["xhal_kv_blocks_free"] == samples["xhal_kv_blocks_total"]
    return samples


def test_greedy_equals_the_offline_engine(server: ServerProcess, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.core import EngineCore
    from serve_cli.engine.sampling import SamplingParams

    texts = prompts(4, 9) + ["hello world"]
    served = greedy(server, texts, max_tokens=12)
    served_stream = client(server).completions.create(
        model="tiny",
        prompt=texts[0],
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    streamed = [t for chunk in served_stream for c in chunk.choices for t in (c.token_ids or [])]

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tokenizer(t)["input_ids"] for t in texts]
    engine = EngineCore(
        EngineConfig(model_dir=model_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    )
    offline = generate(engine, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert served == offline
    assert streamed == offline[0]


def test_chat_and_stop_on_the_checkpoint(server: ServerProcess) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "hello world"}]
    full = c.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].message.content
    # (ids past the 40-odd words of the tokenizer decode to nothing, so the text is short)
    assert full.usage.completion_tokens == 20 and text.split(), text
    stop = text.split()[-1]
    cut = c.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_api_key_is_required(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client(server).completions.create(model="tiny", prompt="hello", max_tokens=2).choices
    assert httpx.get(f"{server.url}/health").status_code == 200  # open: for load balancers


def test_32_concurrent_streams_complete_and_free_every_block(server: ServerProcess) -> None:
    texts = prompts(32, 12, seed=3)

    async def one(c: openai.AsyncOpenAI, text: str, max_tokens: int) -> tuple[str, int]:
        stream = await c.completions.create(
            model="tiny",
            prompt=text,
            max_tokens=max_tokens,
            temperature=0.8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, usage = None, None
        async for chunk in stream:
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        return reason, usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with aclient(server) as c:
            return await asyncio.gather(*(one(c, t, 8 + i % 9) for i, t in enumerate(texts)))

    results = asyncio.run(run())
    assert results == [("length", 8 + i % 9) for i in range(32)]
    assert_all_blocks_free(server)


def test_repeated_long_prompt_hits_the_prefix_cache(server: ServerProcess) -> None:
    text = prompts(1, 120, seed=5)[0]
    before = server.metrics()["xhal_prefix_cache_hits_total"]
    first = client(server).completions.create(model="tiny", prompt=text, max_tokens=2)
    second = client(server).completions.create(model="tiny", prompt=text, max_tokens=2)
    hits = server.metrics()["xhal_prefix_cache_hits_total"] - before
    full_blocks = (first.usage.prompt_tokens - 1) // 16 * 16  # the last token is always computed
    assert full_blocks >= 96
    assert hits >= full_blocks
    assert second.usage.prompt_tokens_details.cached_tokens == full_blocks
    assert server.metrics()["xhal_prefix_cache_hit_rate"] > 0


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server: ServerProcess) -> None:
    max_tokens = MAX_MODEL_LEN - 20
    before = server.metrics()["xhal_generation_tokens_total"]
    aborted_before = server.metrics()[ABORTED]
    body = {
        "model": "tiny",
        "prompt": prompts(1, 16, seed=9)[0],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["xhal_kv_blocks_used"] > 0
    # the client closed the connection mid-stream
    wait_for(lambda: server.metrics()["xhal_kv_blocks_used"] == 0, "blocks still in use")
    samples = assert_all_blocks_free(server)
    assert samples["xhal_generation_tokens_total"] - before < max_tokens  # stopped early
    assert samples[ABORTED] - aborted_before == 1  # counted as vLLM counts it


def test_client_leaving_a_non_streamed_request_aborts_it(server: ServerProcess) -> None:
    max_tokens = MAX_MODEL_LEN - 20
    before = server.metrics()["xhal_generation_tokens_total"]
    body = {"model": "tiny", "prompt": prompts(1, 16, seed=11)[0], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.1)
    wait_for(lambda: server.metrics()["xhal_kv_blocks_used"] == 0, "blocks still in use")
    samples = assert_all_blocks_free(server)
    assert samples["xhal_generation_tokens_total"] - before < max_tokens  # stopped early


def test_bench_serve_reports_the_workload(server: ServerProcess, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from benchmarks.bench_serve import main

    args = ["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6", "--input-len",
            "10", "--output-len", "3", "--request-rate", "50", "--token-ids", "--vocab-size", "40",
            "--no-progress", "--result-json", str(tmp_path / "bench.json")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.output and "P99 TTFT (ms)" in result.output
    summary = json.loads((tmp_path / "bench.json").read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (60, 18)
    assert 0 < summary["p50_ttft_ms"] <= summary["p99_ttft_ms"]


def test_kv_budget_too_small_still_completes_every_request(
    small_kv_server: ServerProcess, server: ServerProcess
) -> None:
    texts = prompts(6, 6, seed=11)  # each needs ceil((6 + 10 - 1) / 4) = 4 blocks, of 8

    async def run() -> list:
        async with aclient(small_kv_server) as c:
            return await asyncio.gather(
                *(
                    c.completions.create(
                        model="tiny",
                        prompt=t,
                        max_tokens=10,
                        temperature=0,
                        extra_body={"return_token_ids": True, "ignore_eos": True},
                    )
                    for t in texts
                )
            )

    outs = asyncio.run(run())
    assert [o.choices[0].finish_reason for o in outs] == ["length"] * 6
    # recomputed after preemption, greedy output is what a roomy cache gives
    assert [o.choices[0].token_ids for o in outs] == greedy(server, texts, max_tokens=10)
    samples = assert_all_blocks_free(small_kv_server)
    assert samples["xhal_num_preemptions_total"] > 0


@pytest.mark.parametrize(
    "sig,group",
    [
        (signal.SIGINT, True),
        (signal.SIGTERM, False),
        (signal.SIGTERM, True),
        (signal.SIGKILL, False),
    ],
    ids=["ctrl-c", "sigterm", "sigterm-group", "sigkill"],
)
def test_shutdown_leaves_no_process(model_dir: Path, sig: int, group: bool) -> None:
    """Ctrl-C in a terminal and systemd signal the whole group; `kill` only the server; after
    SIGKILL the engine notices its parent is gone."""
    srv = ServerProcess(serve_args(model_dir, "--num-kv-blocks", "16"), new_session=True).start()
    engine = engine_pid(srv)
    assert client(srv).completions.create(model="tiny", prompt="hello", max_tokens=2).choices
    if group:
        os.killpg(srv.process.pid, sig)
    else:
        srv.process.send_signal(sig)
    try:
        code = srv.process.wait(GENEROUS_S)
    finally:
        srv.stop(signal.SIGKILL)
    wait_gone([engine], "the engine process outlived the server")
    if sig != signal.SIGKILL:
        assert code in (0, -sig), srv.log()
        assert "Traceback" not in srv.log(), srv.log()


def engine_pid(server: ServerProcess) -> int:
    """The server's engine process: its child started by multiprocessing's spawn."""
    spawned = spawned_children(server.process.pid)
    assert spawned, f"no engine process among the children of {server.process.pid}"
    return spawned[0]
