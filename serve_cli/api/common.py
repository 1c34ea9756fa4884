"""Checks every generation route makes before it starts work."""

from __future__ import annotations

from fastapi import Request

from serve_cli.api.errors import APIError
from serve_cli.api.state import ServerState
from serve_cli.process.engine_client import EngineDeadError, ServerShuttingDown


def server_state(request: Request, model: str | None) -> ServerState:
    """The server's state, once ``model`` names the served model (None: the routes where vLLM
    makes it optional) and the engine is alive."""
    state: ServerState = request.app.state.server
    if model is not None:
        check_model(state, model)
    if state.client.is_dead:
        raise EngineDeadError(state.client.dead_reason)
    if state.draining:
        raise ServerShuttingDown("the server is shutting down; send the request to another one")
    return state


def check_model(state: ServerState, model: str) -> None:
    """404 for a model this server does not serve, as OpenAI and vLLM answer."""
    if model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )
