"""What the engine keeps per live request beside the scheduler's ``Request``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_cli.engine.output import RequestOutput
from serve_cli.engine.request import Request
from serve_cli.engine.sampling import SamplingParams, TokenLogprobs


@dataclass
class RequestState:
    request: Request
    params: SamplingParams
    generator: Any  # the runner's RNG for a seeded request, else None
    seen: Any = None  # the runner's SeenTokens for a request with a penalty or min_tokens
    scheduled_at: float | None = None  # time.monotonic() of its first scheduled step

    def output(
        self,
        new_token_ids: list[int] | None = None,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """This request's output for one step (text is the output processor's to fill in)."""
        request = self.request
        if logprobs is None and self.params.logprobs is not None:
            logprobs = []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids or [],
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            error=error,
            scheduled_at=self.scheduled_at,
        )
