"""What ``EngineCore.step`` reports per request: the delta since the last report."""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_cli.engine.sampling import TokenLogprobs


@dataclass
class RequestOutput:
    """One request's progress in one step.

    ``new_token_ids`` / ``new_text`` are only what this step added (text held back because it
    might start a stop string comes in a later output). The last output of a request has
    ``finished`` true and ``finish_reason`` "stop" (EOS or a stop string), "length" (max_tokens
    or max_model_len), "abort" or "error" (then ``error`` says what failed). ``stop_reason`` is
    what ended a "stop" other than EOS, as vLLM reports it: the stop string, or the id of the
    ``stop_token_ids`` token. ``logprobs`` has one
    entry per new token when the request asked for logprobs, else None. ``num_output_tokens``
    counts every token generated so far (EOS included), for usage.
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
