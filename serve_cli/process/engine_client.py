"""The API process's handle on the engine process: start it, feed it, route its outputs.

Each HTTP request hands ``add_request`` an ``asyncio.Queue``; one background task reads the
engine's output socket (one ``StepOutputs`` of token ids per engine step), makes each output's
text here, in the API process (``OutputProcessor``: incremental detokenization and stop strings,
aborting in the engine a request a stop string ended) and puts every ``RequestOutput`` on the
queue of its request. When the engine
process dies, every waiting queue gets an ``EngineDeadError`` and later calls raise it at once,
so no request hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import tempfile
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from serve_cli.engine.output_processor import OutputProcessor
from serve_cli.process.engine_process import run_engine_process
from serve_cli.process.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    Shutdown,
    StatsQuery,
    StatsReply,
    StepOutputs,
)

if TYPE_CHECKING:
    from serve_cli.engine.config import EngineConfig

logger = logging.getLogger("xhal.serve")


class Unavailable(RuntimeError):
    """The server cannot finish a request (a 503, or an error event in a stream); ``code``
    says why."""

    code = "unavailable"


class EngineDeadError(Unavailable):
    """The engine process is gone; the server can no longer generate."""

    code = "engine_dead"


class ServerShuttingDown(Unavailable):
    """The server is stopping: the request came after the signal, or outlived the grace."""

    code = "server_shutting_down"


class EngineStartupError(RuntimeError):
    """The engine process failed to start (the message says why)."""


class EngineClient:
    """Runs on the API process's event loop; one per server.

    Invariants: a request's queue receives its ``RequestOutput``s (text filled in) in step order
    and is dropped after the finished one (or on ``abort``); sends never block (a gone engine makes
    them fail at once); after the engine process exits, ``dead_reason`` is set and every call raises
    ``EngineDeadError``.
    """

    def __init__(self, config: EngineConfig, log_level: str = "info") -> None:
        self.config, self.log_level = config, log_level
        self.info: EngineReady | None = None
        self.dead_reason: str | None = None
        self.on_dead: Callable[[], None] | None = None  # called once the engine process died
        self._refusal: Unavailable | None = None  # set once fail_all ended everything
        self._queues: dict[str, asyncio.Queue] = {}
        self._outputs: OutputProcessor | None = None  # set by attach_tokenizer
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None
        base = os.path.join(tempfile.gettempdir(), f"xhal-serve-{uuid.uuid4().hex[:12]}")
        self._addrs = (f"ipc://{base}-in", f"ipc://{base}-out")
        # Sending never waits (no high-water mark); receiving is awaited on the event loop.
        self._sync_ctx, self._ctx = zmq.Context(), zmq.asyncio.Context()
        self._inbox = self._sync_ctx.socket(zmq.PUSH)  # to the engine
        self._outbox = self._ctx.socket(zmq.PULL)  # from the engine
        self._inbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.setsockopt(zmq.RCVHWM, 0)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def start(self) -> EngineReady:
        """Spawn the engine process and wait until its model is loaded."""
        self._inbox.bind(self._addrs[0])
        self._outbox.bind(self._addrs[1])
        mp = multiprocessing.get_context("spawn")
        self._process = mp.Process(
            target=run_engine_process,
            args=(self.config, *self._addrs, os.getpid(), self.log_level),
            name="xhal-serve-engine",
            daemon=False,  # it may start tensor-parallel workers; shutdown() always reaps it
        )
        # Born with SIGINT ignored: a Ctrl-C during its (slow) imports must not kill it.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        first = asyncio.ensure_future(self._outbox.recv_pyobj())
        died = asyncio.ensure_future(self._wait_for_exit())
        done, _ = await asyncio.wait({first, died}, return_when=asyncio.FIRST_COMPLETED)
        if first not in done:
            first.cancel()
            raise EngineStartupError(
                f"the engine process exited during start-up (exit code {self._process.exitcode})"
            )
        died.cancel()
        msg = first.result()
        if isinstance(msg, EngineFailed):
            raise EngineStartupError(f"the engine failed to start: {msg.message}")
        assert isinstance(msg, EngineReady), msg
        self.info = msg
        self._reader = asyncio.create_task(self._read_outputs())
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_engine_exit)
        return msg

    def attach_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer whose decode makes the outputs' text; needed before ``add_request``."""
        self._outputs = OutputProcessor(tokenizer)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: Any, queue: asyncio.Queue
    ) -> None:
        """Send a request; its ``RequestOutput``s, or an ``Unavailable`` error, arrive on
        ``queue``."""
        self._check_alive()
        if self._refusal is not None:
            raise self._refusal
        if self._outputs is None:
            raise RuntimeError("attach_tokenizer(...) must be called before add_request(...)")
        prompt = list(prompt_token_ids)
        if not self._send(AddRequest(request_id, prompt, params)):
            raise EngineDeadError("the engine process is not reachable; restart xhal-serve")
        self._outputs.add(request_id, prompt, params.stop, params.min_tokens)
        self._queues[request_id] = queue

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (the client went away); their blocks are freed at the next drain."""
        live = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        for rid in live:
            self._forget(rid)
        if live and not self.is_dead:
            self._send(AbortRequests(live))

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def fail_all(self, error: Unavailable) -> int:
        """End every request in flight with ``error`` and refuse later ones with it (the
        shutdown grace is over); the engine drops them. Returns how many were ended."""
        self._refusal = error
        ids = list(self._queues)
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        for rid in ids:
            self._forget(rid)
        if ids and not self.is_dead:
            self._send(AbortRequests(ids))
        return len(ids)

    async def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The engine's counters and gauges (``EngineCore.stats()``), asked between steps."""
        self._check_alive()
        query_id = next(self._query_ids)
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters[query_id] = waiter
        if not self._send(StatsQuery(query_id)):
            self._stats_waiters.pop(query_id, None)
            raise EngineDeadError("the engine process is not reachable; restart xhal-serve")
        try:
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._stats_waiters.pop(query_id, None)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (politely, then SIGTERM, then SIGKILL). Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            if process.is_alive():
                self._send(Shutdown())
            try:
                asyncio.get_running_loop().remove_reader(process.sentinel)
            except (ValueError, OSError):
                pass
            await _join(process, timeout)
        if self._reader is not None:
            self._reader.cancel()
        self._inbox.close(linger=0)
        self._outbox.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        for addr in self._addrs:
            _unlink(addr.removeprefix("ipc://"))

    async def _read_outputs(self) -> None:
        while True:
            msg = await self._outbox.recv_pyobj()
            if isinstance(msg, StepOutputs):
                self._route(msg)
            elif isinstance(msg, StatsReply):
                waiter = self._stats_waiters.get(msg.query_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg.stats)

    def _route(self, msg: StepOutputs) -> None:
        """Make one step's text and hand each output to its request's queue; the requests a stop
        string ended here are aborted in the engine with one message."""
        assert self._outputs is not None
        stopped = []
        for raw in msg.outputs:
            queue = self._queues.get(raw.request_id)
            if queue is None:  # aborted, or ended here while the engine ran a step behind
                continue
            out, stop_engine = self._outputs.process(raw)
            if out is None:
                continue
            if stop_engine:
                stopped.append(out.request_id)
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.request_id]
        if stopped and not self.is_dead:
            self._send(AbortRequests(stopped))

    def _forget(self, request_id: str) -> None:
        if self._outputs is not None:
            self._outputs.drop(request_id)

    def _on_engine_exit(self) -> None:
        loop = asyncio.get_running_loop()
        if self._process is not None:
            loop.remove_reader(self._process.sentinel)
            self._process.join(timeout=1)
            code = self._process.exitcode
        else:
            code = None
        self.dead_reason = f"the engine process died (exit code {code}); restart xhal-serve"
        logger.error(self.dead_reason)
        error = EngineDeadError(self.dead_reason)
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        if self.on_dead is not None:
            self.on_dead()

    def _send(self, msg: object) -> bool:
        """Send without ever blocking: False when no engine is connected (it exited)."""
        try:
            self._inbox.send_pyobj(msg, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def _wait_for_exit(self) -> None:
        assert self._process is not None
        while self._process.is_alive():
            await asyncio.sleep(0.1)


async def _join(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        deadline = asyncio.get_running_loop().time() + timeout
        while process.is_alive() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if not process.is_alive():
            process.join()
            return


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
