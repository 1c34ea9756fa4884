"""Pydantic models of the response bodies and stream chunks (OpenAI's shapes)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids (a stream's first)
    prompt_logprobs: list[dict[int, Any] | None] | None = None  # vLLM's (logprobs.py)


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # tool_calls.ToolCall.as_dict()


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids
    prompt_logprobs: list[dict[int, Any] | None] | None = None  # vLLM's (logprobs.py)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the first chunk


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "xhal"
    root: str | None = None  # vLLM's: the checkpoint served under this name
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
