"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Bad input is 400 (naming the field), a missing or wrong API key 401, a dead engine 503 and a
failed step 500; the server keeps serving after each.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from serve_cli.process.engine_client import Unavailable

logger = logging.getLogger("xhal.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class APIError(Exception):
    """Raised by a route to answer with an OpenAI-style error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.status)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable) -> JSONResponse:
        return error_response(APIError(503, str(exc), None, exc.code))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), None, None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {exc}", None, "internal_error"))


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming its top-level field (``param``) and, in the
    message, the place inside it."""
    errors = exc.errors()
    if not errors:
        return invalid("invalid request", None)
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return invalid(f"malformed JSON body: {first.get('msg')}", None, "json_invalid")
    if not loc:
        return invalid(f"the request body must be a JSON object: {first.get('msg')}", None)
    param, where = str(loc[0]), _field_path(loc)
    if first.get("type") == "missing":
        return invalid(f"'{where}' is required", param, "missing_required_parameter")
    return invalid(f"'{where}': {first.get('msg')}", param)


# the names pydantic gives the members of a union in an error's location (``prompt.str``)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _field_path(loc: list) -> str:
    """An error's location as the client wrote it (``messages[0].role``): list indices and field
    names, without the union members pydantic names on the way (``list[ContentPart]``)."""
    path = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif str(part).isidentifier() and str(part).islower() and part not in _TYPE_TAGS:
            path += f".{part}"
    return path
