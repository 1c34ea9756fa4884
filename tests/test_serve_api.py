"""xhal-serve's HTTP API, driven with the official ``openai`` client against the real server
process started as the README starts it (built-in default model), plus the fault paths (a
failing step, a dead engine, an engine loop whose step raises) in process.

Every check compares against what the request itself implies (lengths, stop positions, the
text of an unconstrained greedy run) or against OpenAI's documented shapes.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from serve_cli.launcher import ServerProcess

openai = pytest.importorskip("openai", reason="the server tests drive it with the openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")


MODEL = "xhal-tiny-random"
README_EXAMPLES = [  # what the README shows (it may show more: those run too)
    """curl http://127.0.0.1:8000/v1/completions -H "Content-Type: application/json" \\
  -d '{"model": "xhal-tiny-random", "prompt": "The morning was", "max_tokens": 16}'""",
    """curl http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \\
  -d '{"model": "xhal-tiny-random", "messages": [{"role": "user", "content": "Hello!"}],
       "max_tokens": 16}'""",
]


def readme_curl_commands() -> list[str]:
    """The ``curl`` commands of README.md (a command runs on over ``\\`` line ends and open
    single quotes), then those of ``README_EXAMPLES`` it lacks."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    lines = readme.read_text().splitlines() if readme.is_file() else []
    commands, current = [], None
    for line in lines:
        if current is None and line.lstrip().startswith("curl http"):
            current = line.strip()
        elif current is not None:
            current += "\n" + line
        if current is not None and not current.endswith("\\") and current.count("'") % 2 == 0:
            commands.append(current)
            current = None
    return commands + [c for c in README_EXAMPLES if c not in commands]


@pytest.fixture(scope="module")
def server():
    """The README's server: the built-in model (generated once into XHAL_CACHE_DIR)."""
    with ServerProcess(["--log-level", "warning"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def post(server: ServerProcess, path: str, body: Any, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        headers = {"Content-Type": "application/json"}
        return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=60)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


# --- the happy paths, through the openai client ------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_not_streamed(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="The morning was",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_streamed_matches_not_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello! Thank you", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_token_id_and_batched_prompts(client: openai.OpenAI) -> None:
    single = client.completions.create(
        model=MODEL,
        prompt="One, two, three",
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    # the same prompt as token ids, and twice in one request
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=1).choices
    assert len(ids) == 1
    batch = client.completions.create(
        model=MODEL, prompt=["One, two, three"] * 2, max_tokens=5, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert {c.text for c in batch.choices} == {single.choices[0].text}
    assert batch.usage.prompt_tokens == 2 * single.usage.prompt_tokens


def test_n_samples(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="The children",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    again = client.completions.create(
        model=MODEL,
        prompt="The children",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    streamed = client.completions.create(
        model=MODEL,
        prompt="The children",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        prompt="Where did you put",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs).choices[0].text
    # three plain characters from the second half (whole characters, not split bytes)
    windows = [full[i : i + 3] for i in range(len(full) // 2, len(full) - 2)]
    stop = next((w for w in windows if w.isascii() and w.strip().isalnum()), None)
    assert stop, f"need a visible stop string in {full!r}"
    cut = full[: full.index(stop)]
    out = client.completions.create(**kwargs, stop=[stop, "never-appears"]).choices[0]
    assert (out.text, out.finish_reason) == (cut, "stop")
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="Why is the sky",
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy took the best


def test_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    message = out.choices[0].message
    assert message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    usage = chunks[-1].usage  # (cached_tokens may differ: the second run hits the prefix cache)
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        out.usage.prompt_tokens,
        out.usage.completion_tokens,
    )


def test_chat_n_and_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_health_and_metrics(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = server.metrics()
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "prefix_cache_hit_rate",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "time_per_output_token_seconds_count",
    ):
        assert f"xhal_{name}" in samples
    assert samples["xhal_generation_tokens_total"] > 0
    assert samples['xhal_time_to_first_token_seconds_bucket{le="+Inf"}'] > 0


def test_readme_curl_examples(server: ServerProcess) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    for example in readme_curl_commands():
        check_curl_example(server, example)


def check_curl_example(server: ServerProcess, example: str) -> None:
    command = example.replace("localhost:8000", "127.0.0.1:8000")
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    command = command.replace("curl ", "curl -sS --fail-with-body ", 1)
    out = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"{example}\n{out.stdout}{out.stderr}"
    if out.stdout.startswith("data:"):  # a streaming example
        assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout
        return
    reply = json.loads(out.stdout)
    assert reply["object"] in ("text_completion", "chat.completion"), reply
    assert reply["usage"]["completion_tokens"] >= 1 and reply["choices"][0]["finish_reason"]


# --- bad input: 400 naming the field, and the server keeps serving ------------------------------

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
BAD_INPUTS = [
    ("missing model", {k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ("unknown model", {**GOOD, "model": "gpt-7"}, "model"),
    ("max_tokens 0", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens < 0", {**GOOD, "max_tokens": -3}, "max_tokens"),
    ("prompt too long", {**GOOD, "prompt": [5] * 2049}, "prompt"),  # max_model_len 2048
    ("temperature < 0", {**GOOD, "temperature": -0.5}, "temperature"),
    ("top_p 0", {**GOOD, "top_p": 0}, "top_p"),
    ("top_p > 1", {**GOOD, "top_p": 1.5}, "top_p"),
    ("n 0", {**GOOD, "n": 0}, "n"),
    ("stop not a string", {**GOOD, "stop": 42}, "stop"),
    ("stop list of ints", {**GOOD, "stop": [1, 2]}, "stop"),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("token id out of vocab", {**GOOD, "prompt": [10**9]}, "prompt"),
]


@pytest.mark.parametrize(
    "body,param", [(b, p) for _, b, p in BAD_INPUTS], ids=[name for name, _, _ in BAD_INPUTS]
)
def test_bad_completion_input_is_400(server: ServerProcess, body: dict, param: str) -> None:
    for stream in (False, True):
        response = post(server, "/v1/completions", {**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert error["message"]
    assert post(server, "/v1/completions", GOOD).status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 2100}]}, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
def test_bad_chat_input_is_400(server: ServerProcess, body: dict, param: str) -> None:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_malformed_json_is_400(server: ServerProcess) -> None:
    for raw in (b'{"model": "xhal-tiny-random", "prompt": ', b"[1, 2]", b"not json"):
        response = post(server, "/v1/completions", None, raw=raw)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", GOOD).status_code == 200


# --- fault paths, in process: a scripted engine behind the real app -----------------------------


class ScriptedEngine:
    """Stands in for ``EngineClient``: each request emits ``max_tokens`` tokens, except that a
    prompt starting with token 13 fails in its second step (as a failing engine step would)."""

    def __init__(self) -> None:
        self.dead_reason: str | None = None
        self.aborted: list[str] = []

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def add_request(self, request_id, prompt_token_ids, params, queue) -> None:
        from serve_cli.messages import Output

        async def run() -> None:
            for i in range(params.max_tokens):
                await asyncio.sleep(0)
                if prompt_token_ids[0] == 13 and i == 1:
                    queue.put_nowait(
                        Output(
                            request_id,
                            finished=True,
                            finish_reason="error",
                            error="RuntimeError: injected",
                            status=500,
                        )
                    )
                    return
                last = i == params.max_tokens - 1
                queue.put_nowait(
                    Output(
                        request_id,
                        [7],
                        "x",
                        last,
                        "length" if last else None,
                        num_prompt_tokens=len(prompt_token_ids),
                    )
                )

        asyncio.get_running_loop().create_task(run())

    def abort(self, request_ids) -> None:
        self.aborted += request_ids

    async def stats(self) -> dict:
        return {"kv_blocks_total": 4, "kv_blocks_free": 4}


@pytest.fixture
def scripted_app():
    from serve_cli.api import ServerState, build_app
    from serve_cli.default_model import build_tokenizer

    engine = ScriptedEngine()
    state = ServerState(
        engine,
        build_tokenizer(),
        MODEL,
        max_model_len=64,
        vocab_size=100,
        block_size=16,
        num_kv_blocks=4,
    )
    return build_app(state), engine


def _run(app, method: str, path: str, body: Any = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, json=body)

    return asyncio.run(go())


def test_failed_step_is_500_and_the_next_request_works(scripted_app) -> None:
    app, engine = scripted_app
    response = _run(
        app, "POST", "/v1/completions", {"model": MODEL, "prompt": [13, 5], "max_tokens": 4, "n": 2}
    )
    assert response.status_code == 500
    assert "injected" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "server_error"
    ok = _run(app, "POST", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xxx"


def test_failed_step_while_streaming_is_an_error_event(scripted_app) -> None:
    app, _ = scripted_app
    response = _run(
        app,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": [13], "max_tokens": 4, "stream": True},
    )
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "injected" in json.loads(events[-2])["error"]["message"]


def test_dead_engine_is_503(scripted_app) -> None:
    app, engine = scripted_app
    engine.dead_reason = "the engine process died (exit code -9); restart xhal-serve"
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = _run(app, "POST", path, body)
        assert response.status_code == 503
        assert "engine process died" in response.json()["error"]["message"]
    assert _run(app, "GET", "/health").status_code == 503


class RaisingCore:
    """An ``EngineCore`` stand-in whose first step raises out of ``step`` itself."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.aborted: list[str] = []
        self.fail_next = True

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        from serve_cli.engine.errors import ParamError

        if not prompt_token_ids:
            raise ParamError("prompt", "needs at least one token")
        self.live[request_id] = params.max_tokens

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)
        self.live.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        from serve_cli.engine.output import RequestOutput

        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step failure")
        outs = [RequestOutput(rid, [3], "a", True, "length") for rid in self.live]
        self.live.clear()
        return outs

    def stats(self) -> dict:
        return {"num_running": len(self.live)}


def test_engine_loop_survives_a_raising_step() -> None:
    import os
    import threading

    import zmq

    from serve_cli.engine.sampling import SamplingParams
    from serve_cli.engine_process import EngineLoop
    from serve_cli.messages import AddRequest, Shutdown, StatsQuery, StatsReply, StepOutputs

    ctx = zmq.Context()
    to_engine, engine_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_in.bind("inproc://in")
    to_engine.connect("inproc://in")
    from_engine.bind("inproc://out")
    engine_out.connect("inproc://out")
    core, params = RaisingCore(), SamplingParams(max_tokens=1)
    for rid in ("a", "b"):
        to_engine.send_pyobj(AddRequest(rid, [1, 2], params))
    to_engine.send_pyobj(StatsQuery(7))
    loop = EngineLoop(core, engine_in, engine_out, os.getppid())
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        assert from_engine.recv_pyobj() == StatsReply(7, {"num_running": 2})
        failed = from_engine.recv_pyobj()
        assert isinstance(failed, StepOutputs)
        assert {(o.request_id, o.finish_reason, o.status) for o in failed.outputs} == {
            ("a", "error", 500),
            ("b", "error", 500),
        }
        assert all("injected step failure" in o.error for o in failed.outputs)
        assert sorted(core.aborted) == ["a", "b"]  # their blocks were freed
        # the loop keeps serving: a bad request is rejected (400), a good one completes
        to_engine.send_pyobj(AddRequest("c", [], params))
        to_engine.send_pyobj(AddRequest("d", [1], params))
        rejected, done = from_engine.recv_pyobj().outputs, from_engine.recv_pyobj().outputs
        assert [(o.request_id, o.status, o.param) for o in rejected] == [("c", 400, "prompt")]
        assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in done] == [
            ("d", "length", [3])
        ]
    finally:
        to_engine.send_pyobj(Shutdown())
        thread.join(10)
        for sock in (to_engine, engine_in, engine_out, from_engine):
            sock.close(linger=0)
        ctx.term()
    assert not thread.is_alive()


# --- the command line ---------------------------------------------------------------------------


def test_cli_help_explains_every_option() -> None:
    from click.testing import CliRunner

    from serve_cli.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--device",
        "--model",
        "--host",
        "--port",
        "--dtype",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--block-size",
        "--kv-cache-memory",
        "--num-kv-blocks",
        "--tensor-parallel-size",
        "--enforce-eager",
        "--served-model-name",
        "--api-key",
        "--seed",
    ):
        assert option in result.output
    assert "127.0.0.1" in result.output  # localhost unless told otherwise


def test_cli_rejects_an_unknown_device_listing_the_known_ones() -> None:
    from click.testing import CliRunner

    import xhal.platforms
    from serve_cli.cli import main

    result = CliRunner().invoke(main, ["--device", "tpu9000"])
    assert result.exit_code == 2
    assert "tpu9000" in result.output
    assert all(name in result.output for name in xhal.platforms.names())


def test_cli_names_a_missing_package_and_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from click.testing import CliRunner

    from serve_cli.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a)
    )
    result = CliRunner().invoke(main, [])
    assert result.exit_code == 1
    assert "pip install pyzmq" in result.output


def test_cli_parses_kv_cache_sizes() -> None:
    from serve_cli.cli import ByteSize

    size = ByteSize()
    assert [size.convert(v, None, None) for v in ("1024", "2KiB", "1.5G", "512MiB")] == [
        1024,
        2048,
        1_500_000_000,
        512 * 2**20,
    ]
    with pytest.raises(Exception, match="not a size"):
        size.convert("lots", None, None)
