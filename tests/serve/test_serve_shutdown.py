"""xhal-serve stopping under load (issue 18 item 5), against the real server process: SIGTERM lets
requests in flight finish within --shutdown-timeout and refuses new connections; past the grace,
streams end with an in-band error event and plain requests with a JSON 503; a dead engine ends
the server with exit status 1 once its requests are answered. No traceback in any log. Every wait
is on an event (a chunk, a metric, a process exit) under a generous bound."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from tests.support.launcher import ServerProcess
from tests.support.processes import spawned_children, wait_for
from tests.support.tiny_server import TINY_MODEL_NAME, tiny_server_args

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

EXIT_S = 300.0  # generous: how long a loaded machine may take to drain and stop


def start(*extra: str) -> ServerProcess:
    # eager: the quickest steps on the CPU, so the finishing requests below take least time
    args = tiny_server_args("--log-level", "info", "--enforce-eager", *extra)
    return ServerProcess(args).start()


def body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": "The morning was", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


def stream_events(server: ServerProcess, max_tokens: int, started: Future) -> list[Any]:
    """The stream's data events (parsed JSON; "[DONE]" as is); ``started`` is set at the first."""
    out: list[Any] = []
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body(max_tokens, True), timeout=EXIT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
                if not started.done():
                    started.set_result(True)
    return out


def plain(server: ServerProcess, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body(max_tokens, False), timeout=EXIT_S)


def under_load(server: ServerProcess, max_tokens: int, act) -> tuple[list[Any], httpx.Response]:
    """A stream and a plain request in flight together, then ``act()``; returns their results."""
    with ThreadPoolExecutor(2) as pool:
        started: Future = Future()
        streamed = pool.submit(stream_events, server, max_tokens, started)
        whole = pool.submit(plain, server, max_tokens)
        started.result(EXIT_S)
        wait_for(lambda: server.metrics()["xhal_num_requests_running"] == 2, "both not running")
        act()
        return streamed.result(EXIT_S), whole.result(EXIT_S)


def refuses_connections(server: ServerProcess) -> bool:
    try:
        httpx.get(f"{server.url}/health", timeout=10)
    except httpx.TransportError:
        return True
    return False


def exit_code(server: ServerProcess) -> int:
    assert server.process is not None
    return server.process.wait(EXIT_S)


def test_sigterm_lets_requests_in_flight_finish() -> None:
    server = start("--shutdown-timeout", "600")
    try:

        def sigterm() -> None:
            server.process.send_signal(signal.SIGTERM)
            # stops accepting while the two requests still run
            wait_for(lambda: refuses_connections(server), "still accepting after SIGTERM")

        events, response = under_load(server, 64, sigterm)
        assert events[-1] == "[DONE]"
        finish = [
            c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]
        ]
        assert finish == ["length"] and "error" not in json.dumps(events)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 64
        assert exit_code(server) in (0, -signal.SIGTERM), server.log()
        log = server.log()
        assert "Traceback" not in log, log
        assert "2 in flight get up to 600 s" in log, log  # they were running at the signal
    finally:
        server.stop(signal.SIGKILL)


def test_past_the_grace_streams_get_an_error_event_and_requests_a_503() -> None:
    server = start("--shutdown-timeout", "1")
    try:
        events, response = under_load(
            server, 2000, lambda: server.process.send_signal(signal.SIGTERM)
        )
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
        assert all("error" not in e for e in events[:-2])  # tokens came until then
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "server_shutting_down"
        assert exit_code(server) in (0, -signal.SIGTERM), server.log()
        log = server.log()
        assert "Traceback" not in log and "ended 2 unfinished requests" in log, log
    finally:
        server.stop(signal.SIGKILL)


def test_engine_death_answers_in_flight_requests_then_exits_non_zero() -> None:
    server = start()
    try:
        (engine,) = spawned_children(server.process.pid)
        events, response = under_load(server, 2000, lambda: os.kill(engine, signal.SIGKILL))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_dead"
        assert exit_code(server) == 1, server.log()
        log = server.log()
        assert "engine process died" in log and "Traceback" not in log, log
    finally:
        server.stop(signal.SIGKILL)
