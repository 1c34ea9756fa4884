"""Small routes a vLLM client expects besides generation: ``/version``, ``/ping`` and
``GET /v1/models/{id}``."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request, Response

from serve_cli.api.common import check_model
from serve_cli.api.responses import ModelCard
from serve_cli.api.state import ServerState

router = APIRouter()


def model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=state.model_root,
        max_model_len=state.max_model_len,
    )


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    state: ServerState = request.app.state.server
    check_model(state, model_id)
    return model_card(state)


@router.get("/version")
async def version() -> dict[str, str]:
    try:
        return {"version": metadata.version("xhal")}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "unknown"}


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    """200 while the engine is alive, 503 once it died: what /health says, without a body
    (SageMaker-style health checks, as vLLM answers them)."""
    state: ServerState = request.app.state.server
    return Response(status_code=503 if state.client.is_dead else 200)
