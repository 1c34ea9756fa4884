"""The FastAPI application: routes, the API-key guard and the error handlers."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_cli.api import chat, completions, info, tokenization
from serve_cli.api.errors import APIError, error_response, install_handlers
from serve_cli.api.responses import ModelList
from serve_cli.api.state import ServerState

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(
    state: ServerState, on_shutdown: Callable[[], Awaitable[None]] | None = None
) -> FastAPI:
    """The app serving ``state``. ``on_shutdown`` runs when uvicorn shuts the app down (the server
    stops the engine process there, before uvicorn re-raises the signal that stopped it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="xhal-serve", lifespan=lifespan)
    app.state.server = state
    install_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(tokenization.router)
    app.include_router(info.router)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[info.model_card(state)])

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.client.is_dead:
            body = {"status": "engine_dead", "message": state.client.dead_reason}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        stats: dict[str, Any] = {} if state.client.is_dead else await state.client.stats()
        text = state.metrics.render(stats, state.model_name)
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

    if state.api_key:
        app.add_middleware(ApiKeyGuard, api_key=state.api_key)
    return app


class ApiKeyGuard:
    """401 for ``/v1/*`` requests without ``Authorization: Bearer <key>`` (a plain ASGI
    middleware, so streaming and disconnect detection pass through untouched). The scheme is
    case-insensitive (RFC 7235: ``bearer KEY`` is the same credential); the key is not."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = given.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                error = APIError(401, "missing or invalid API key", None, "invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
