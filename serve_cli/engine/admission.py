"""The checks a request passes before the engine queues it (the engine's public entry point may
be called directly, not only by the API, so it checks again what the API checked on arrival,
with the same rules)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from serve_cli.engine.errors import ParamError
from serve_cli.engine.prompt_rules import prompt_problem
from serve_cli.engine.sampling import SamplingParams
from serve_cli.engine.served_model import ServedModel


def admit(
    request_id: object,
    prompt_token_ids: Sequence[int],
    params: object,
    live: Container[str],
    model: ServedModel,
) -> list[int]:
    """The prompt as a list, or ``ParamError`` naming what is wrong. ``params`` is checked by
    type only: a ``SamplingParams`` validated itself when it was made."""
    if not isinstance(request_id, str) or not request_id:
        raise ParamError("request_id", f"must be a non-empty string, got {request_id!r}")
    if request_id in live:
        raise ParamError("request_id", f"{request_id!r} is already used by a live request")
    if not isinstance(params, SamplingParams):
        raise ParamError("params", f"expected SamplingParams, got {type(params).__name__}")
    outside = next((t for t, _ in params.logit_bias if t >= model.vocab_size), None)
    if outside is not None:
        raise ParamError(
            "logit_bias", f"token id {outside} is outside the vocabulary [0, {model.vocab_size})"
        )
    prompt = list(prompt_token_ids)
    problem = prompt_problem(prompt, model.vocab_size, model.max_model_len)
    if problem is not None:
        raise ParamError("prompt", problem.message)
    return prompt
