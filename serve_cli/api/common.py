"""Checks every generation route makes before it starts work."""

from __future__ import annotations

from fastapi import Request

from serve_cli.api.errors import invalid
from serve_cli.api.state import ServerState
from serve_cli.engine_client import EngineDeadError


def server_state(request: Request, model: str) -> ServerState:
    """The server's state, once ``model`` names the served model and the engine is alive."""
    state: ServerState = request.app.state.server
    if model != state.model_name:
        raise invalid(
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )
    if state.client.is_dead:
        raise EngineDeadError(state.client.dead_reason)
    return state
