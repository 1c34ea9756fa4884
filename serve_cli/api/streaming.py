"""Server-sent events: ``data: <json>`` per chunk, an error event if generation fails, then
``data: [DONE]``. Once a stream has started its HTTP status is sent, so a failure mid-stream
can only be reported in-band, as OpenAI does: ``data: {"error": {...}}``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from serve_cli.api.errors import APIError, error_body
from serve_cli.process.engine_client import Unavailable

logger = logging.getLogger("xhal.serve")


def sse_response(chunks: AsyncIterator[BaseModel | dict[str, Any]]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_events(chunks), media_type="text/event-stream", headers=headers)


async def _events(chunks: AsyncIterator[BaseModel | dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield _data(chunk)
    except APIError as e:
        logger.warning("stream failed: %s", e.message)
        yield _data(error_body(e.status, e.message, e.param, e.code))
    except Unavailable as e:  # the engine died, or the server is shutting down
        yield _data(error_body(503, str(e), None, e.code))
    except Exception as e:  # a bug here must not leave the client hanging without [DONE]
        logger.exception("stream failed")
        yield _data(error_body(500, f"internal error: {e}", None, "internal_error"))
    yield "data: [DONE]\n\n"


def _data(chunk: BaseModel | dict[str, Any]) -> str:
    if isinstance(chunk, BaseModel):
        return f"data: {chunk.model_dump_json()}\n\n"
    return f"data: {json.dumps(chunk)}\n\n"
