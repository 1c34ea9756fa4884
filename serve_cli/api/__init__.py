"""The OpenAI-compatible HTTP API (FastAPI): request models, routes, errors, metrics.

It runs in the API process: it tokenizes and validates, hands requests to the engine process
through ``serve_cli.process.engine_client.EngineClient`` and streams the outputs back.
"""

from __future__ import annotations

from serve_cli.api.app import build_app
from serve_cli.api.state import ServerState

__all__ = ["ServerState", "build_app"]
