"""``POST /v1/completions``: text or token-id prompts, one or many, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from serve_cli.api.choice import Choice
from serve_cli.api.common import server_state
from serve_cli.api.defaults import with_defaults
from serve_cli.api.errors import invalid
from serve_cli.api.generation import Generation, new_id
from serve_cli.api.logprobs import completion_logprobs
from serve_cli.api.params import COMPLETION_DEFAULT_MAX_TOKENS, sampling_params
from serve_cli.api.prompts import check_context_length, check_fits, completion_prompts
from serve_cli.api.protocol import CompletionRequest
from serve_cli.api.responses import CompletionChoice, CompletionResponse
from serve_cli.api.state import ServerState
from serve_cli.api.streaming import sse_response

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = server_state(request, body.model)
    if body.echo and body.logprobs is not None:
        raise invalid(
            "'echo' with 'logprobs' needs the prompt's logprobs, which xhal-serve does not "
            "compute; leave one of them out",
            "echo",
            "unsupported_parameter",
        )
    # tokenizing a long prompt takes a while: off the event loop, so other requests go on
    prompts = await run_in_threadpool(completion_prompts, state, body.prompt)
    echoed = _echoed(state, body.prompt, prompts) if body.echo else None
    max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    fields = with_defaults(body, state.defaults)
    params = sampling_params(fields, max_tokens, body.logprobs, state.vocab_size)
    for ids in prompts:
        if body.max_tokens:
            check_context_length(state, len(ids), max_tokens, "max_tokens")
        check_fits(state, len(ids), max_tokens, "max_tokens")
    gen = Generation(state, new_id("cmpl"), prompts, params, body.n)
    header = dict(id=gen.request_id, created=int(time.time()))
    if body.stream:
        return sse_response(_chunks(state, body, gen, header, echoed))
    if not await gen.run_to_end(request):
        return Response(status_code=499)  # the client left; nobody reads this
    choices = [_choice(state, body, c, c.text, c.token_ids, c.logprobs) for c in gen.choices]
    if echoed is not None:
        for choice in choices:
            choice.text = echoed[choice.index // body.n] + choice.text
    return CompletionResponse(**header, model=state.model_name, choices=choices, usage=gen.usage())


def _echoed(state: ServerState, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text, as ``echo`` repeats it: the text sent, or token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [state.tokenizer.decode(ids) for ids in prompts]


async def _chunks(
    state: ServerState,
    body: CompletionRequest,
    gen: Generation,
    header: dict[str, Any],
    echoed: list[str] | None,
) -> AsyncIterator[CompletionResponse]:
    for choice in gen.choices if echoed is not None else ():  # each prompt's text comes first
        part = CompletionChoice(index=choice.index, text=echoed[choice.index // body.n])
        yield CompletionResponse(**header, model=state.model_name, choices=[part])
    async for choice, out in gen.outputs():
        wants_tokens = body.return_token_ids or body.logprobs is not None
        if not (out.new_text or out.finished or (wants_tokens and out.new_token_ids)):
            continue  # text held back (a possible stop string) or not yet a whole character
        offset = len(choice.text) - len(out.new_text)
        entries = list(out.logprobs or [])
        choice_out = _choice(state, body, choice, out.new_text, out.new_token_ids, entries, offset)
        choice_out.finish_reason = out.finish_reason if out.finished else None
        choice_out.stop_reason = out.stop_reason if out.finished else None
        yield CompletionResponse(**header, model=state.model_name, choices=[choice_out])
    if body.include_usage:
        yield CompletionResponse(**header, model=state.model_name, choices=[], usage=gen.usage())


def _choice(
    state: ServerState,
    body: CompletionRequest,
    choice: Choice,
    text: str,
    token_ids: list[int],
    entries: list[Any],
    offset: int = 0,
) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, entries, offset)
    return CompletionChoice(
        index=choice.index,
        text=text,
        logprobs=logprobs,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        token_ids=list(token_ids) if body.return_token_ids else None,
    )
