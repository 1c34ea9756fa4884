"""Request fields -> the engine's ``SamplingParams`` (checked again by its ``validate()``)."""

from __future__ import annotations

from serve_cli.api.errors import invalid
from serve_cli.api.protocol import SamplingFields
from serve_cli.engine.errors import ParamError
from serve_cli.engine.sampling import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(
    request: SamplingFields, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    stop = request.stop
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        seed=request.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logprobs=logprobs,
        ignore_eos=request.ignore_eos,
    )
    try:
        params.validate()
    except ParamError as e:
        raise invalid(f"'{e.param}': {e.message}", e.param) from e
    return params
