"""``POST /v1/completions``: text or token-id prompts, one or many, streamed or not."""

from __future__ import annotations

import dataclasses
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
from serve_cli.api.logprobs import completion_logprobs, prompt_entries, vllm_prompt_logprobs
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
    if body.max_tokens == 0 and not body.echo:
        raise invalid(
            "'max_tokens' must be at least 1 (0 only with 'echo', to score the prompt alone)",
            "max_tokens",
        )
    # tokenizing a long prompt takes a while: off the event loop, so other requests go on
    prompts = await run_in_threadpool(
        completion_prompts, state, body.prompt, body.add_special_tokens, body.truncate_prompt_tokens
    )
    echo = _Echo(state, body, prompts) if body.echo else None
    # max_tokens 0 (echo alone): the engine makes one token, which is dropped
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    fields = with_defaults(body, state.defaults)
    params = sampling_params(fields, max(max_tokens, 1), body.logprobs, state.vocab_size)
    if echo is not None and body.logprobs is not None:  # the prompt's logprobs are echoed too
        wanted = max(body.logprobs, params.prompt_logprobs or 0)
        params = dataclasses.replace(params, prompt_logprobs=wanted)
    for ids in prompts:
        if body.max_tokens:
            check_context_length(state, len(ids), max_tokens, "max_tokens")
        check_fits(state, len(ids), max(max_tokens, 1), "max_tokens")
    gen = Generation(state, new_id("cmpl"), prompts, params, body.n)
    header = dict(id=gen.request_id, created=int(time.time()))
    if body.stream:
        return sse_response(_chunks(state, body, gen, header, echo))
    if not await gen.run_to_end(request):
        return Response(status_code=499)  # the client left; nobody reads this
    if max_tokens == 0:
        for c in gen.choices:
            c.text, c.token_ids, c.logprobs = "", [], []
    choices = []
    for c in gen.choices:
        head, entries = echo.of(c) if echo is not None else ("", [])
        out = _choice(state, body, c, head + c.text, c.token_ids, entries + c.logprobs)
        if body.return_token_ids:
            out.prompt_token_ids = list(c.prompt_token_ids)
        if body.prompt_logprobs is not None and c.prompt_logprobs:
            out.prompt_logprobs = vllm_prompt_logprobs(
                state.tokenizer, _top(c.prompt_logprobs, body.prompt_logprobs)
            )
        choices.append(out)
    return CompletionResponse(**header, model=state.model_name, choices=choices, usage=gen.usage())


def _top(scored: list[Any], k: int) -> list[Any]:
    """Prompt scores with their ``k`` likeliest only (echo's logprobs may have asked for more)."""
    return [e if e is None else e._replace(top=e.top[:k]) for e in scored]


class _Echo:
    """What ``echo`` puts before each choice: its prompt's text (the text sent, or token ids
    decoded) and, with ``logprobs``, its prompt tokens' entries."""

    def __init__(self, state: ServerState, body: CompletionRequest, prompts: list[list[int]]):
        prompt = body.prompt
        if body.truncate_prompt_tokens is not None:  # what the model saw, not what was sent
            self.texts = [state.tokenizer.decode(ids) for ids in prompts]
        elif isinstance(prompt, str):
            self.texts = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            self.texts = list(prompt)
        else:
            self.texts = [state.tokenizer.decode(ids) for ids in prompts]
        self.n, self.prompts, self.k = body.n, prompts, body.logprobs

    def of(self, choice: Choice) -> tuple[str, list[Any]]:
        """``choice``'s echoed text and logprob entries (none until its prompt's arrive, or
        without ``logprobs``)."""
        i = choice.index // self.n
        if self.k is None or not choice.prompt_logprobs:
            return self.texts[i], []
        return self.texts[i], prompt_entries(self.prompts[i], _top(choice.prompt_logprobs, self.k))


async def _chunks(
    state: ServerState,
    body: CompletionRequest,
    gen: Generation,
    header: dict[str, Any],
    echo: _Echo | None,
) -> AsyncIterator[CompletionResponse]:
    echoed: set[int] = set()  # the choices whose prompt went out (with their first output)
    opened: set[int] = set()  # the choices whose first chunk went out
    alone = body.max_tokens == 0  # echo only: the one generated token is dropped
    async for choice, out in gen.outputs():
        wants_tokens = body.return_token_ids or body.logprobs is not None
        new_text, token_ids = ("", []) if alone else (out.new_text, out.new_token_ids)
        entries = [] if alone else list(out.logprobs or [])
        head, start = "", len(choice.text) - len(out.new_text)  # this chunk's place in the text
        if echo is not None and choice.index not in echoed:  # the prompt goes with it
            echoed.add(choice.index)
            head, prompt = echo.of(choice)
            entries, start = prompt + entries, 0
        elif not (new_text or out.finished or (wants_tokens and token_ids)):
            continue  # text held back (a possible stop string) or not yet a whole character
        elif echo is not None:
            start += len(echo.of(choice)[0])
        choice_out = _choice(state, body, choice, head + new_text, token_ids, entries, start)
        if body.return_token_ids and choice.index not in opened:  # the prompt's ids come first
            opened.add(choice.index)
            choice_out.prompt_token_ids = list(choice.prompt_token_ids)
        choice_out.finish_reason = out.finish_reason if out.finished else None
        choice_out.stop_reason = out.stop_reason if out.finished else None
        yield CompletionResponse(**header, model=state.model_name, choices=[choice_out])
    if body.include_usage:
        if alone:
            for c in gen.choices:
                c.token_ids = []
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
