"""Turning request prompts into token ids, and the checks on them (400s naming the field)."""

from __future__ import annotations

from typing import Any

from serve_cli.api.errors import invalid
from serve_cli.api.protocol import ChatMessage, ChatTemplateFields
from serve_cli.api.state import ServerState
from serve_cli.engine.prompt_rules import prompt_problem


def completion_prompts(
    state: ServerState, prompt: Any, add_special_tokens: bool = True, keep: int | None = None
) -> list[list[int]]:
    """``prompt`` (a string, a list of strings, token ids or a list of token-id lists) -> one
    token-id list per prompt (its last ``keep`` tokens when given: vLLM's
    ``truncate_prompt_tokens``)."""
    if isinstance(prompt, str):
        prompts = [encode(state, prompt, "prompt", add_special_tokens)]
    elif not prompt:
        raise invalid("'prompt' must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [encode(state, p, "prompt", add_special_tokens) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if keep is not None:
        prompts = [ids[-keep:] for ids in prompts]
    for ids in prompts:
        check_prompt(state, ids, "prompt")
    return prompts


# apply_chat_template's own arguments: chat_template_kwargs must not override them
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "continue_final_message",
     "chat_template", "tools", "documents", "return_dict"}
)  # fmt: skip


def chat_prompt(
    state: ServerState, body: ChatTemplateFields, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The conversation rendered by the chat template (the tokenizer's, or the request's
    ``chat_template``), with ``tools`` when given, ending in the assistant's turn or, with
    ``continue_final_message``, in the open last message, as token ids."""
    special = getattr(body, "add_special_tokens", False)
    ids = encode(state, render_chat(state, body, tools), "messages", special)
    keep = getattr(body, "truncate_prompt_tokens", None)
    if keep is not None:
        ids = ids[-keep:]
    check_prompt(state, ids, "messages")
    return ids


def render_chat(
    state: ServerState, body: ChatTemplateFields, tools: list[dict[str, Any]] | None = None
) -> str:
    """The conversation through the chat template, with ``tools`` (OpenAI's, as dicts) shown to
    the model when given."""
    tokenizer = state.tokenizer
    template = body.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid(
            "this model's tokenizer has no chat template; use /v1/completions with a plain "
            "prompt, or pass one as 'chat_template'",
            "messages",
            "no_chat_template",
        )
    if body.add_generation_prompt and body.continue_final_message:
        raise invalid(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: either the "
            "model continues the last message or it starts a new turn; set "
            "'add_generation_prompt': false",
            "continue_final_message",
        )
    extra = dict(body.chat_template_kwargs or {})
    clash = sorted(_TEMPLATE_ARGUMENTS & extra.keys())
    if clash:
        raise invalid(
            f"'chat_template_kwargs' may not set {', '.join(clash)}: give them as request fields",
            "chat_template_kwargs",
        )
    # a message's other fields (an assistant's tool_calls, a tool reply's tool_call_id) reach
    # the template as sent
    conversation = [
        {**(m.model_extra or {}), "role": m.role, "content": message_text(m, i)}
        for i, m in enumerate(body.messages)
    ]
    if tools is not None:
        extra["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **extra,
        )
    except Exception as e:  # a template may raise on a conversation it does not accept
        raise invalid(f"the chat template rejected the messages: {e}", "messages") from e


def check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    problem = prompt_problem(ids, state.vocab_size, state.max_model_len, param)
    if problem is not None:
        raise invalid(problem.message, param, problem.code or "invalid_value")


def encode(state: ServerState, text: str, param: str, add_special_tokens: bool) -> list[int]:
    """``text`` as token ids; a 400 naming ``param`` for text that is not Unicode (JSON can carry
    a lone UTF-16 surrogate, ``"\\ud800"``, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(
            f"'{param}' is not valid Unicode: it holds a lone surrogate (U+{ord(text[e.start]):04X}"
            f" at character {e.start}); a \\ud800-\\udfff escape must be half of a pair",
            param,
        ) from None
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise invalid(
                f"messages[{index}]: content parts of type {part.type!r} are not supported "
                "(text only)",
                "messages",
            )
        parts.append(part.text)
    return "".join(parts)


def check_fits(state: ServerState, num_prompt_tokens: int, max_tokens: int, param: str) -> None:
    """Reject up front a request that could not fit in the whole KV cache even alone (the
    engine would refuse it too, but only after a stream had started)."""
    final_len = max(min(num_prompt_tokens + max_tokens, state.max_model_len), num_prompt_tokens + 1)
    need = -(-(final_len - 1) // state.block_size)
    if need > state.num_kv_blocks:
        raise invalid(
            f"{num_prompt_tokens} prompt tokens + up to {max_tokens} output tokens need {need} KV "
            f"blocks of {state.block_size} tokens, but the server's cache has "
            f"{state.num_kv_blocks} in all; lower max_tokens or shorten the prompt",
            param,
            "kv_cache_too_small",
        )


def check_context_length(
    state: ServerState, num_prompt_tokens: int, max_tokens: int, param: str
) -> None:
    """A ``max_tokens`` the client asked for that runs past the context is refused (vLLM does),
    not clamped: a clamped request would end "length" earlier than the client was told."""
    if num_prompt_tokens + max_tokens > state.max_model_len:
        raise invalid(
            f"this model's maximum context length is {state.max_model_len} tokens, but "
            f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in '{param}'); lower '{param}' or shorten the prompt",
            param,
            "context_length_exceeded",
        )
