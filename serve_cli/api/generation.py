"""One HTTP request's engine work: ``n`` engine requests per prompt, one shared output queue.

``Generation`` starts the engine requests lazily (on the first ``outputs()`` step), so a stream
whose client never reads starts nothing, and aborts every unfinished one when iteration stops
early (a disconnected client, an error), which frees their KV blocks in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from serve_cli.api.choice import Choice
from serve_cli.api.errors import APIError
from serve_cli.api.request_log import log_request
from serve_cli.api.responses import PromptTokensDetails, Usage
from serve_cli.api.state import ServerState
from serve_cli.engine.output import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def client_left(request: Any) -> None:
    """Return when the client closes its connection. The request body has been read by now, so
    the next ASGI message is ``http.disconnect``; waiting on it wakes at once, where polling
    ``is_disconnected`` would notice only at its next poll."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """Choice ``i`` serves prompt ``i // n``; with a seed, choice ``i`` samples with ``seed + i``
    so the ``n`` samples of a prompt differ yet stay reproducible."""

    def __init__(
        self, state: ServerState, request_id: str, prompts: list[list[int]], params: Any, n: int
    ) -> None:
        self.state, self.params, self.n, self.request_id = state, params, n, request_id
        self.arrival = time.monotonic()
        self.choices = [
            Choice(i, f"{request_id}-{i}", prompts[i // n], arrival=self.arrival)
            for i in range(len(prompts) * n)
        ]
        state.metrics.on_http_request(n, params.max_tokens)
        self._by_id = {c.request_id: c for c in self.choices}
        self.num_prompt_tokens = sum(len(p) for p in prompts)

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each engine output with its choice, in arrival order, until every choice finished.
        Raises ``APIError`` for a request the engine failed or rejected, ``EngineDeadError``
        when the engine process died."""
        queue: asyncio.Queue = asyncio.Queue()
        client, metrics = self.state.client, self.state.metrics
        try:
            for choice in self.choices:
                choice.started = time.monotonic()
                client.add_request(
                    choice.request_id, choice.prompt_token_ids, self._params_for(choice), queue
                )
            unfinished = len(self.choices)
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                choice = self._by_id[item.request_id]
                self._apply(choice, item)
                if item.finish_reason == "error":
                    metrics.on_finished(choice)
                    message = item.error or "the engine failed this request"
                    if item.status == 400:
                        raise APIError(400, message, item.param, "invalid_value")
                    raise APIError(500, message, None, "engine_error")
                if item.finished:
                    unfinished -= 1
                    metrics.on_finished(choice)
                yield choice, item
        finally:
            left = [c for c in self.choices if c.finish_reason is None]
            client.abort([c.request_id for c in left])
            for choice in left:  # counted as vLLM counts them, under "abort"
                metrics.on_finished(choice)
            log_request(self)

    async def run_to_end(self, request: Any) -> bool:
        """Consume every output for a non-streamed response while listening for the client
        leaving; if it leaves, stop at once, which aborts the unfinished engine requests (their
        KV blocks come back). Returns False when the client left."""

        async def consume() -> None:
            async for _ in self.outputs():
                pass

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(client_left(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            for job in (gone, task):
                with contextlib.suppress(asyncio.CancelledError):
                    await job
        if task.cancelled():
            return False
        task.result()  # raises what the generation raised
        return True

    def usage(self) -> Usage:
        completion = sum(len(c.token_ids) for c in self.choices)
        # a prompt is counted once however many samples it has, as OpenAI does
        cached = sum(c.num_cached_tokens for c in self.choices[:: self.n])
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def _params_for(self, choice: Choice) -> Any:
        if self.params.seed is None or choice.index == 0:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + choice.index)

    def _apply(self, choice: Choice, out: RequestOutput) -> None:
        if choice.scheduled_at is None:
            choice.scheduled_at = out.scheduled_at
        if out.new_token_ids:
            now = time.monotonic()
            self.state.metrics.on_token(choice, now)
            if choice.first_token is None:
                choice.first_token = now
            choice.last_token = now
        choice.text += out.new_text
        choice.token_ids += out.new_token_ids
        if out.logprobs:
            choice.logprobs += list(out.logprobs)
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = list(out.prompt_logprobs)
        choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
