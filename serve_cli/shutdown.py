"""Graceful shutdown: on SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the
open ones; this lets requests in flight run on for ``shutdown_timeout`` seconds, then ends every
one still running with ``ServerShuttingDown`` (a 503, or an error event in a stream), so that
uvicorn's wait ends with every client answered instead of cancelled mid-response.

A dying engine process ends the server too (``exit_when_engine_dies``): its requests are answered
with 503s, then uvicorn stops and ``serve`` exits non-zero, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from serve_cli.process.engine_client import ServerShuttingDown

logger = logging.getLogger("xhal.serve")
# uvicorn's own limit, a backstop behind ours: ended requests answer within moments
BACKSTOP_S = 30.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server that tells ``on_first_signal`` (on the event loop) when the first
    SIGTERM / SIGINT arrives; uvicorn then shuts down as usual (a second Ctrl-C forces it)."""

    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_first_signal = on_first_signal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: it may run between any two bytecodes of the loop's thread, so it
        # only schedules the work on the loop
        first = not self._signalled
        self._signalled = True
        super().handle_exit(sig, frame)
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_first_signal)


class Drain:
    """What happens between the signal and the end: new requests are refused at once (the
    ``draining`` flag the routes check), those in flight get ``timeout`` seconds."""

    def __init__(self, state: Any, client: Any, timeout: float) -> None:
        self.state, self.client, self.timeout = state, client, timeout

    def begin(self) -> None:
        self.state.draining = True
        logger.info(
            "shutting down: no new requests; %d in flight get up to %.0f s to finish",
            self.client.num_in_flight, self.timeout,
        )  # fmt: skip
        asyncio.get_running_loop().call_later(self.timeout, self.expire)

    def expire(self) -> None:
        ended = self.client.fail_all(
            ServerShuttingDown(
                f"the server is shutting down and this request did not finish within its "
                f"{self.timeout:g} s grace (--shutdown-timeout); send it again"
            )
        )
        if ended:
            logger.warning("shutdown grace over: ended %d unfinished requests", ended)


def exit_when_engine_dies(client: Any, server: uvicorn.Server) -> None:
    """Once the engine process is gone, stop serving (after its requests got their 503s)."""

    def stop() -> None:
        server.should_exit = True

    client.on_dead = stop
