"""A read-back step -> the scheduler advanced and one ``RequestOutput`` per request it touched.

The engine ends requests only on what token ids say: EOS (unless ``ignore_eos``), a token of
``stop_token_ids``, or the length limits the scheduler applies. Text and stop strings are the
output processor's, in the API process (``serve_cli.engine.output_processor``).
"""

from __future__ import annotations

from serve_cli.engine.output import RequestOutput
from serve_cli.engine.request import RequestStatus
from serve_cli.engine.request_state import RequestState
from serve_cli.engine.scheduler import Scheduler
from serve_cli.engine.step_pipeline import DeviceStep


class PostProcessor:
    """Turns read-back steps into outputs; keeps the token counters metrics report."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int]) -> None:
        self.scheduler, self.eos_token_ids = scheduler, eos_token_ids
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def outputs(self, step: DeviceStep, states: dict[str, RequestState]) -> list[RequestOutput]:
        """Advance the scheduler for ``step`` and return its outputs; finished requests leave
        ``states``. A failed step fails every live request of its batch (reason "error")."""
        if step.error is not None:
            return self._fail(step, step.error, states)
        for rid, (first, entries) in step.scores.items():
            if step.is_live(rid, states):
                states[rid].add_prompt_scores(first, entries)
        sampled = [s for s in step.sampled if step.is_live(s.request_id, states)]
        finished: dict[str, RequestStatus] = {}
        stop_tokens: dict[str, int] = {}
        for s in sampled:
            params = states[s.request_id].params
            eos = s.token_id in self.eos_token_ids and not params.ignore_eos
            if s.token_id in params.stop_token_ids and not eos:
                stop_tokens[s.request_id] = s.token_id
            if eos or s.request_id in stop_tokens:
                finished[s.request_id] = RequestStatus.FINISHED_STOPPED
        tokens = {s.request_id: s.token_id for s in sampled}
        done = {r.request_id for r in self.scheduler.advance(step.batch, tokens, finished)}

        outputs = []
        for s in sampled:
            rid = s.request_id
            state = states.pop(rid) if rid in done else states[rid]
            self.generation_tokens_total += 1
            if state.request.num_output_tokens == 1:  # the prompt is fully processed
                self.prompt_tokens_total += state.request.num_prompt_tokens
            reason = state.request.finish_reason if rid in done else None
            logprobs = None if s.logprobs is None else [s.logprobs]
            output = state.output([s.token_id], reason, logprobs)
            if reason == "stop":
                output.stop_reason = stop_tokens.get(rid)
            outputs.append(output)
        return outputs

    def _fail(
        self, step: DeviceStep, error: str, states: dict[str, RequestState]
    ) -> list[RequestOutput]:
        live = [rid for rid in step.states if step.is_live(rid, states)]
        self.scheduler.advance(step.batch, {}, {rid: RequestStatus.FINISHED_ERROR for rid in live})
        return [states.pop(rid).output(finish_reason="error", error=error) for rid in live]
