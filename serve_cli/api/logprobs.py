"""Engine logprobs (``(token_id, logprob, ((id, logprob), ...))`` per token) in OpenAI's two
shapes: the legacy completions object and the chat ``content`` list."""

from __future__ import annotations

from typing import Any


def completion_logprobs(
    tokenizer: Any, entries: list[tuple[int, float | None, tuple | None]], text_offset: int = 0
) -> dict[str, Any]:
    """Each token's ``top_logprobs`` holds the most likely tokens and, as OpenAI always returns
    it, the token itself (so up to N + 1 entries). An entry with no logprob (an echoed prompt's
    first token) gets null for it and its top."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, logprob, top in entries:
        token = _token(tokenizer, token_id)
        tokens.append(token)
        token_logprobs.append(logprob)
        ranked: dict[str, float] | None = None if top is None else {}
        for t, lp in top or ():  # most likely first; tokens that decode alike keep the best
            ranked.setdefault(_token(tokenizer, t), lp)
        if ranked is not None:
            ranked.setdefault(token, logprob)
        top_logprobs.append(ranked)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def prompt_entries(prompt: list[int], scored: list[Any] | None) -> list[tuple]:
    """An echoed prompt's entries for ``completion_logprobs``: its first token without a logprob,
    then the engine's scores (``prompt_logprobs``) of the others."""
    if not scored:
        return []
    return [(prompt[0], None, None), *((e.token_id, e.logprob, e.top) for e in scored[1:])]


def vllm_prompt_logprobs(tokenizer: Any, scored: list[Any]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` shape: per prompt token, None for the first, else
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token and the likeliest there."""
    out: list[dict[str, Any] | None] = [None]
    for entry in scored[1:]:
        ranked = {
            t: {"logprob": lp, "rank": rank, "decoded_token": _token(tokenizer, t)}
            for rank, (t, lp) in enumerate(entry.top, 1)
        }
        ranked.setdefault(entry.token_id, {
            "logprob": entry.logprob, "rank": entry.rank,
            "decoded_token": _token(tokenizer, entry.token_id),
        })  # fmt: skip
        out.append(ranked)
    return out


def chat_logprobs(tokenizer: Any, entries: list[tuple[int, float, tuple]]) -> dict[str, Any]:
    content = []
    for token_id, logprob, top in entries:
        content.append(
            {
                **_entry(tokenizer, token_id, logprob),
                "top_logprobs": [_entry(tokenizer, t, lp) for t, lp in top],
            }
        )
    return {"content": content}


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    token = _token(tokenizer, token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _token(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])
