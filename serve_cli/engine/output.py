"""The one output type from engine to API: what a request added in one step.

The engine process fills it with token ids (``EngineCore.step``) and sends it as it is over ZMQ;
in the API process ``OutputProcessor`` fills in ``new_text`` and applies stop strings. Plain data
only (``TokenLogprobs`` and ``PromptLogprob`` are named tuples), so the API process needs neither
torch nor the engine's other classes to read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_cli.engine.sampling import PromptLogprob, TokenLogprobs


@dataclass
class RequestOutput:
    """One request's progress in one step.

    ``new_token_ids`` / ``new_text`` are only what this step added (text held back because it
    might start a stop string comes in a later output; the engine leaves ``new_text`` empty and
    the output processor fills it). The last output of a request has ``finished`` true and
    ``finish_reason`` "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort" or "error" (then ``error`` says what failed, and ``status`` is the
    HTTP status to answer with: 400 when the engine rejected the request on arrival, ``param``
    naming the field when it said which; 500 when a step failed). ``stop_reason`` is what ended
    a "stop" other than EOS, as vLLM reports it: the stop string, or the id of the
    ``stop_token_ids`` token. ``logprobs`` has one entry per new token when the request asked for
    logprobs, else None. ``num_output_tokens`` counts every token generated so far (EOS
    included), for usage. ``prompt_logprobs`` (with the first output of a request that asked for
    them) has an entry per prompt token, None for the first.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    stop_reason: int | str | None = None
    scheduled_at: float | None = None  # time.monotonic() when first scheduled (for metrics)
    status: int = 500
    param: str | None = None  # the offending request field, for a rejected request
    prompt_logprobs: list[PromptLogprob | None] | None = None


def failed_output(
    request_id: str, message: str, status: int = 500, param: str | None = None
) -> RequestOutput:
    """The last output of a request that failed (``status`` 400: rejected on arrival)."""
    return RequestOutput(
        request_id, finished=True, finish_reason="error", error=message, status=status, param=param
    )
