"""What a servable prompt is: the one statement of the rules the API checks on arrival and the
engine checks for callers that reach it directly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptProblem:
    """The first rule a prompt breaks: ``message`` for the client, ``code`` an OpenAI-style
    error code when one applies."""

    message: str
    code: str | None = None


def prompt_problem(
    ids: Sequence[object], vocab_size: int, max_model_len: int, param: str = "prompt"
) -> PromptProblem | None:
    """None when ``ids`` can be served: at least one token, integer ids in ``[0, vocab_size)``,
    at most ``max_model_len`` of them. ``param`` names the field in the messages."""
    if not ids:
        return PromptProblem(f"'{param}' must not be empty (it encodes to no tokens)")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return PromptProblem(f"'{param}' token ids must be integers")
    if len(ids) > max_model_len:
        return PromptProblem(
            f"the prompt has {len(ids)} tokens, more than this server's max model length "
            f"({max_model_len}); shorten it or restart with a larger --max-model-len",
            "context_length_exceeded",
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return PromptProblem(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return None
