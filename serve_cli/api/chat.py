"""``POST /v1/chat/completions``: the conversation through the tokenizer's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from serve_cli.api.common import server_state
from serve_cli.api.defaults import with_defaults
from serve_cli.api.generation import Generation, new_id
from serve_cli.api.logprobs import chat_logprobs, vllm_prompt_logprobs
from serve_cli.api.params import sampling_params
from serve_cli.api.prompts import chat_prompt, check_context_length, check_fits, message_text
from serve_cli.api.protocol import ChatCompletionRequest
from serve_cli.api.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
)
from serve_cli.api.state import ServerState
from serve_cli.api.streaming import sse_response
from serve_cli.api.tool_calls import StreamedReply, offered_tools, parse

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = server_state(request, body.model)
    tools = offered_tools(body, state.tool_call_parser)  # None: the reply is read as plain text
    prompt = await run_in_threadpool(chat_prompt, state, body, tools)  # off the event loop
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens(state, prompt)
    if body.max_completion_tokens or body.max_tokens:
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        check_context_length(state, len(prompt), max_tokens, param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fields = with_defaults(body, state.defaults)
    params = sampling_params(fields, max_tokens, logprobs, state.vocab_size)
    check_fits(state, len(prompt), max_tokens, "max_tokens")
    gen = Generation(state, new_id("chatcmpl"), [prompt], params, body.n)
    header = dict(id=gen.request_id, created=int(time.time()), model=state.model_name)
    role, echoed = reply_role(body), echoed_text(body)
    if body.stream:
        return sse_response(_chunks(state, body, gen, header, tools is not None))
    if not await gen.run_to_end(request):
        return Response(status_code=499)  # the client left; nobody reads this
    choices = []
    for c in gen.choices:
        content, calls = parse(c.text) if tools is not None else (c.text, [])
        calls = calls[: _max_calls(body)]
        if echoed:
            content = echoed + (content or "")
        message = ChatMessageOut(
            role=role, content=content, tool_calls=[t.as_dict() for t in calls] or None
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(state.tokenizer, c.logprobs) if body.logprobs else None,
                finish_reason="tool_calls" if calls else c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if body.return_token_ids else None,
            )
        )
    prompt_ids = prompt if body.return_token_ids else None
    scored = gen.choices[0].prompt_logprobs if body.prompt_logprobs is not None else None
    prompt_logprobs = vllm_prompt_logprobs(state.tokenizer, scored) if scored else None
    return ChatCompletionResponse(
        **header, choices=choices, usage=gen.usage(), prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def default_max_tokens(state: ServerState, prompt: list[int]) -> int:
    """A chat request without a limit: the server's default, capped by what fits; with none, up
    to the model's length (as vLLM does) or what the whole KV cache holds."""
    longest = min(state.max_model_len, state.num_kv_blocks * state.block_size + 1)
    fits = max(1, longest - len(prompt))
    limit = state.defaults.chat_max_tokens
    return fits if limit is None else min(limit, fits)


def _max_calls(body: ChatCompletionRequest) -> int | None:
    """How many of a reply's calls are returned: the first only with parallel_tool_calls false."""
    return 1 if body.parallel_tool_calls is False else None


async def _chunks(
    state: ServerState,
    body: ChatCompletionRequest,
    gen: Generation,
    header: dict[str, Any],
    calls_tools: bool,
) -> AsyncIterator[ChatCompletionChunk]:
    role, echoed = reply_role(body), echoed_text(body)
    for c in gen.choices:  # the role comes first, as OpenAI streams it
        delta = ChatMessageOut(role=role, content="")
        prompt_ids = c.prompt_token_ids if body.return_token_ids and c.index == 0 else None
        part = ChatChunkChoice(index=c.index, delta=delta)
        yield ChatCompletionChunk(**header, choices=[part], prompt_token_ids=prompt_ids)
        if echoed:
            delta = ChatMessageOut(content=echoed)
            part = ChatChunkChoice(index=c.index, delta=delta)
            yield ChatCompletionChunk(**header, choices=[part])
    wants_tokens = body.return_token_ids or body.logprobs
    # with tools, text that may be a call is held until the choice ends (tool_calls.py)
    replies = {c.index: StreamedReply() for c in gen.choices}
    async for choice, out in gen.outputs():
        text = replies[choice.index].feed(out.new_text) if calls_tools else out.new_text
        calls = []
        if out.finished and calls_tools:
            tail, calls = replies[choice.index].finish()
            text += tail
            calls = calls[: _max_calls(body)]
        if text or (wants_tokens and out.new_token_ids):
            delta = ChatMessageOut(content=text)
            logprobs = chat_logprobs(state.tokenizer, out.logprobs or []) if body.logprobs else None
            token_ids = out.new_token_ids if body.return_token_ids else None
            part = ChatChunkChoice(
                index=choice.index, delta=delta, logprobs=logprobs, token_ids=token_ids
            )
            yield ChatCompletionChunk(**header, choices=[part])
        if out.finished:
            delta = ChatMessageOut(tool_calls=[t.as_dict(i) for i, t in enumerate(calls)] or None)
            part = ChatChunkChoice(
                index=choice.index,
                delta=delta,
                finish_reason="tool_calls" if calls else out.finish_reason,
                stop_reason=out.stop_reason,
            )
            yield ChatCompletionChunk(**header, choices=[part])
    if body.include_usage:
        yield ChatCompletionChunk(**header, choices=[], usage=gen.usage())


def reply_role(body: ChatCompletionRequest) -> str:
    """The assistant's, or with no generation prompt the open last message's (vLLM's rule)."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def echoed_text(body: ChatCompletionRequest) -> str:
    """With ``echo``, the reply repeats the last message when it has the reply's role (the
    message the model continues), as vLLM does; otherwise nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != reply_role(body):
        return ""
    return message_text(last, len(body.messages) - 1)
