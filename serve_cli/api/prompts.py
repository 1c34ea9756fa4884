"""Turning request prompts into token ids, and the checks on them (400s naming the field)."""

from __future__ import annotations

from typing import Any

from serve_cli.api.errors import invalid
from serve_cli.api.protocol import ChatMessage
from serve_cli.api.state import ServerState


def completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """``prompt`` (a string, a list of strings, token ids or a list of token-id lists) -> one
    token-id list per prompt."""
    if isinstance(prompt, str):
        prompts = [_encode(state, prompt, add_special_tokens=True)]
    elif not prompt:
        raise invalid("'prompt' must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [_encode(state, p, add_special_tokens=True) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    for ids in prompts:
        check_prompt(state, ids, "prompt")
    return prompts


def chat_prompt(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    """The conversation rendered by the tokenizer's chat template, ending in the assistant's
    turn, as token ids."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(
            "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
            "messages",
            "no_chat_template",
        )
    conversation = [{"role": m.role, "content": _text(m, i)} for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # a template may raise on a conversation it does not accept
        raise invalid(f"the chat template rejected the messages: {e}", "messages") from e
    ids = _encode(state, text, add_special_tokens=False)
    check_prompt(state, ids, "messages")
    return ids


def check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise invalid(f"'{param}' must not be empty (it encodes to no tokens)", param)
    if len(ids) > state.max_model_len:
        raise invalid(
            f"the prompt has {len(ids)} tokens, more than this server's max model length "
            f"({state.max_model_len}); shorten it or restart with a larger --max-model-len",
            param,
            "context_length_exceeded",
        )
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})", param)


def _encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _text(message: ChatMessage, index: int) -> str:
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
