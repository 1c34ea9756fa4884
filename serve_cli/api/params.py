"""Request fields -> the engine's ``SamplingParams`` (checked again by its ``validate()``)."""

from __future__ import annotations

from serve_cli.api.errors import invalid
from serve_cli.api.protocol import SamplingFields
from serve_cli.engine.errors import ParamError
from serve_cli.engine.sampling import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# OpenAI and vLLM request fields that change what is sampled and that xhal-serve does not
# implement, with the values that leave sampling as it is. Unknown fields are otherwise ignored;
# these are refused when set to anything else, since ignoring them would answer a different
# request than the one sent.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "bad_words": ([], None),
    "response_format": ({"type": "text"}, None),
    "tools": ([], None),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "logits_processors": (None,),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
    # what a completion or chat request may ask beyond sampling that xhal-serve does not do
    "suffix": (None, ""),
    "best_of": (None, 1),
    "functions": (None, []),
    "function_call": (None, "none"),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True),  # chat takes false too (protocol.py)
}


def refuse_unimplemented(request: SamplingFields) -> None:
    """400 for a field of ``NOT_IMPLEMENTED`` set to a value that would change sampling."""
    extra = request.model_extra or {}
    for name, neutral in NOT_IMPLEMENTED.items():
        if name in extra and extra[name] not in neutral:
            raise invalid(
                f"'{name}' is not supported by xhal-serve; leave it out (or at "
                f"{neutral[0]!r}) to sample without it",
                name,
                "unsupported_parameter",
            )


def refuse_inconsistent(request: SamplingFields) -> None:
    """400 for fields that only mean something together with another one, as vLLM refuses them
    (accepting them would silently drop what the client asked for)."""
    if request.stream_options is not None and not request.stream:
        raise invalid(
            "'stream_options' only applies to a streamed request; set 'stream': true or leave "
            "'stream_options' out",
            "stream_options",
        )
    if request.prompt_logprobs is not None and request.stream:
        raise invalid(
            "'prompt_logprobs' come with the whole response, not a stream; set 'stream': false",
            "prompt_logprobs",
        )
    best_of = (request.model_extra or {}).get("best_of")
    if isinstance(best_of, int) and best_of < request.n:
        raise invalid(
            f"'best_of' ({best_of}) must be at least 'n' ({request.n}): it is how many are "
            "sampled to return n; leave 'best_of' out",
            "best_of",
        )
    wants_top = getattr(request, "top_logprobs", None) is not None
    if wants_top and getattr(request, "logprobs", None) is not True:
        raise invalid(
            "'top_logprobs' needs 'logprobs': true; set it, or leave 'top_logprobs' out",
            "top_logprobs",
        )


def sampling_params(
    request: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    refuse_unimplemented(request)
    refuse_inconsistent(request)
    stop = request.stop
    bias = _logit_bias(request.logit_bias, vocab_size)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            seed=request.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            logprobs=logprobs,
            ignore_eos=request.ignore_eos,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=request.repetition_penalty or 1.0,
            logit_bias=bias,
            min_p=request.min_p or 0.0,
            min_tokens=request.min_tokens or 0,
            prompt_logprobs=request.prompt_logprobs,
        )
    except ParamError as e:
        raise invalid(f"'{e.param}': {e.message}", e.param) from e


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as ``SamplingParams.logit_bias`` pairs, in id order."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise invalid(
                f"'logit_bias' keys are token ids in [0, {vocab_size}) (as strings), got {key!r}",
                "logit_bias",
            )
        pairs.append((token, value))
    return tuple(sorted(pairs))
