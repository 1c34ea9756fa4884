"""xhal-serve's fault paths, in process: a scripted engine behind the real app (a failing step, a
failing step mid-stream, a dead engine) and an engine loop whose step raises."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.support.scripted_engine import ScriptedEngine
from tests.support.tiny_server import TINY_MODEL_NAME as MODEL
from tests.support.tiny_server import tiny_tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")


@pytest.fixture
def scripted_app():
    from serve_cli.api import ServerState, build_app

    engine = ScriptedEngine()
    state = ServerState(
        engine,
        tiny_tokenizer(),
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


def test_requests_while_draining_are_503(scripted_app) -> None:
    """After SIGTERM a request on a connection still open is refused, not started."""
    app, engine = scripted_app
    app.state.server.draining = True
    for body in ({"model": MODEL, "prompt": [5], "max_tokens": 2},
                 {"model": MODEL, "prompt": [5], "max_tokens": 2, "stream": True}):  # fmt: skip
        response = _run(app, "POST", "/v1/completions", body)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "server_shutting_down"
    assert engine.requests == []


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
    from serve_cli.process.engine_process import EngineLoop
    from serve_cli.process.messages import AddRequest, Shutdown, StatsQuery, StatsReply, StepOutputs

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
