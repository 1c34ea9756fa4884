"""A stand-in for ``EngineClient`` that answers from a script, and ``call`` to send one request to
the app in process, for in-process tests of the API."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class ScriptedEngine:
    """Stands in for ``EngineClient``: each request emits ``max_tokens`` tokens, except that a
    prompt starting with token 13 fails in its second step (as a failing engine step would).
    With ``reply``, each request writes that text instead, ``piece`` characters an output, and
    stops ("stop")."""

    def __init__(self, reply: str | None = None, piece: int = 4) -> None:
        self.reply, self.piece = reply, piece
        self.dead_reason: str | None = None
        self.aborted: list[str] = []
        self.requests: list[tuple[list[int], object]] = []  # (prompt token ids, params) received

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def add_request(self, request_id, prompt_token_ids, params, queue) -> None:
        self.requests.append((list(prompt_token_ids), params))
        from serve_cli.engine.output import RequestOutput

        async def run() -> None:
            scheduled_at = time.monotonic()
            if self.reply is not None:
                pieces = range(0, len(self.reply), self.piece)
                for i in pieces:
                    await asyncio.sleep(0)
                    last = i == pieces[-1]
                    out = RequestOutput(request_id, [7], self.reply[i : i + self.piece], last,
                                        "stop" if last else None,
                                        num_prompt_tokens=len(prompt_token_ids))  # fmt: skip
                    queue.put_nowait(out)
                return
            for i in range(params.max_tokens):
                await asyncio.sleep(0)
                if prompt_token_ids[0] == 13 and i == 1:
                    queue.put_nowait(
                        RequestOutput(
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
                    RequestOutput(
                        request_id,
                        [7],
                        "x",
                        last,
                        "length" if last else None,
                        num_prompt_tokens=len(prompt_token_ids),
                        scheduled_at=scheduled_at,
                    )
                )

        asyncio.get_running_loop().create_task(run())

    def abort(self, request_ids) -> None:
        self.aborted += request_ids

    async def stats(self) -> dict:
        """What ``EngineCore.stats`` reports, with fixed values a test can check against."""
        from serve_cli.histogram import Histogram

        iteration = Histogram((1, 8, 16))
        for num_tokens in (1, 9, 40):
            iteration.observe(num_tokens)
        return {"kv_blocks_total": 4, "kv_blocks_used": 1, "kv_blocks_free": 3, "num_running": 2,
                "num_waiting": 1, "prompt_tokens_total": 50, "generation_tokens_total": 7,
                "prefix_cache_queries": 40, "prefix_cache_hits": 10, "num_preemptions_total": 3,
                "iteration_tokens": iteration.to_dict()}  # fmt: skip


def call(app: Any, method: str, path: str, body: Any = None) -> Any:
    """One request to the ASGI ``app`` in this process (no server, no port): its ``httpx``
    response."""
    import httpx

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, json=body)

    return asyncio.run(go())
