"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the server's own tokenizer and chat template,
so a client counts tokens exactly as a generation request would."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from serve_cli.api.common import check_model
from serve_cli.api.errors import invalid
from serve_cli.api.prompts import check_prompt, encode, render_chat
from serve_cli.api.protocol import ChatTemplateFields, ToolDefinition
from serve_cli.api.state import ServerState

router = APIRouter()


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tools: list[ToolDefinition] | None = None  # shown to the model as a chat request shows them
    add_special_tokens: bool = False  # the template already wrote them
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(min_length=1)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize")
async def tokenize(body: dict[str, Any], request: Request) -> TokenizeResponse:
    state = _state(request, body.get("model"))
    # vLLM tells the two shapes apart by their fields; pydantic then checks the one chosen
    parsed: TokenizeChatRequest | TokenizeCompletionRequest
    if "messages" in body:
        parsed = _parse(TokenizeChatRequest, body)
        tools = [t.model_dump(exclude_none=True) for t in parsed.tools or ()] or None
        param, text = "messages", await run_in_threadpool(render_chat, state, parsed, tools)
    else:
        parsed = _parse(TokenizeCompletionRequest, body)
        param, text = "prompt", parsed.prompt
    # a long text takes a while: off the event loop, so other requests go on meanwhile
    ids = await run_in_threadpool(encode, state, text, param, parsed.add_special_tokens)
    strs = state.tokenizer.convert_ids_to_tokens(ids) if parsed.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = _state(request, body.model)
    check_prompt(state, body.tokens, "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))


def _state(request: Request, model: Any) -> ServerState:
    state: ServerState = request.app.state.server
    if model is not None:
        check_model(state, str(model))
    return state


def _parse(model_cls: type[BaseModel], body: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        if first.get("type") == "extra_forbidden":
            raise invalid(f"'{param}' is not a field of /tokenize", param, "unsupported_parameter")
        raise invalid(f"'{param}': {first.get('msg')}", param) from e
