"""What the engine keeps per live request beside the scheduler's ``Request``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_cli.engine.output import RequestOutput
from serve_cli.engine.request import Request
from serve_cli.engine.sampling import PromptLogprob, SamplingParams, TokenLogprobs


@dataclass
class RequestState:
    request: Request
    params: SamplingParams
    generator: Any  # the runner's RNG for a seeded request, else None
    seen: Any = None  # the runner's SeenTokens for a request with a penalty or min_tokens
    scheduled_at: float | None = None  # time.monotonic() of its first scheduled step
    # with prompt_logprobs: an entry per prompt position scored so far (None for the first),
    # sent with its first output
    prompt_logprobs: list[PromptLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def add_prompt_scores(self, first: int, entries: list[PromptLogprob]) -> None:
        """Scores of prompt positions ``first ..``; those already recorded (a preempted request
        computes its prompt again) are kept as they were."""
        recorded = self.prompt_logprobs
        if recorded is None:
            return
        for position, entry in enumerate(entries, first):
            if position == len(recorded):
                recorded.append(entry)

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
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = list(self.prompt_logprobs), True
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
            prompt_logprobs=prompt_logprobs,
        )
