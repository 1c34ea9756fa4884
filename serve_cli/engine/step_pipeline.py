"""Async pipelining: which batch is launched on the device, and which is read back, per step.

With overlap on, ``advance`` schedules and launches step N+1 first (the requests step N samples
for feed placeholders, filled on the device from step N's tokens), then reads step N back (its
one sync); step N+1 stays in flight until the next ``advance``. Without it each batch is launched
and read back in the same call. A batch whose launch fails is read back at once, as failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serve_cli.engine.batch import ScheduledBatch
from serve_cli.engine.request_state import RequestState
from serve_cli.engine.scheduler import Scheduler
from serve_cli.histogram import Histogram

if TYPE_CHECKING:
    from serve_cli.engine.runner.model_runner import LaunchedStep, ModelRunner, SampledToken

logger = logging.getLogger(__name__)
# vLLM's buckets of its iteration-tokens histogram
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class DeviceStep:
    """A scheduled batch on its way through the device: ``launched`` once queued there,
    ``sampled`` once read back, or ``error`` when either failed. ``states`` are its requests'
    states when it was scheduled; a request whose state is gone (or replaced) since has its
    results dropped."""

    batch: ScheduledBatch
    states: dict[str, RequestState] = field(default_factory=dict)
    launched: LaunchedStep | None = None
    sampled: list[SampledToken] = field(default_factory=list)
    # prompt scores read back: request id -> (first prompt position, TokenLogprobs entries)
    scores: dict[str, tuple[int, list]] = field(default_factory=dict)
    error: str | None = None

    def is_live(self, rid: str, states: dict[str, RequestState]) -> bool:
        return states.get(rid) is self.states[rid]


class StepPipeline:
    """Launches scheduled batches on the runner and reads them back, at most one in flight."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, overlap: bool) -> None:
        self.runner, self.scheduler, self.overlap = runner, scheduler, overlap
        self.in_flight: DeviceStep | None = None  # launched, not read back yet
        self.num_preemptions = 0
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)

    def advance(self, states: dict[str, RequestState]) -> list[DeviceStep]:
        """Launch the next batch and return the steps read back now, oldest first."""
        previous, self.in_flight = self.in_flight, None
        current = self._launch_next(previous, states)  # step N+1, before step N is read back
        if current is not None and current.error is None and self.overlap:
            self.in_flight, current = current, None  # read back by the next advance()
        done = [s for s in (previous, current) if s is not None]
        for step in done:
            self._collect(step)
        return done

    def settle(self, states: dict[str, RequestState]) -> DeviceStep | None:
        """Read back the step in flight at once when every request in it has finished since:
        it holds their blocks, and nothing it computed is wanted."""
        step = self.in_flight
        if step is None or any(step.is_live(rid, states) for rid in step.states):
            return None
        self.in_flight = None
        self._collect(step)
        return step

    def _launch_next(
        self, previous: DeviceStep | None, states: dict[str, RequestState]
    ) -> DeviceStep | None:
        batch = self.scheduler.next_batch()
        if batch is None:
            return None
        self.num_preemptions += len(batch.preempted_ids)
        self.iteration_tokens.observe(batch.num_tokens)
        step = DeviceStep(batch, {s.request_id: states[s.request_id] for s in batch.requests})
        now = time.monotonic()
        for state in step.states.values():
            if state.scheduled_at is None:
                state.scheduled_at = now
        try:
            params = {rid: s.params for rid, s in step.states.items()}
            generators = {
                rid: s.generator for rid, s in step.states.items() if s.generator is not None
            }
            seen = {rid: s.seen for rid, s in step.states.items() if s.seen is not None}
            prior = None if previous is None else previous.launched
            step.launched = self.runner.launch(batch, params, generators, prior, seen)
        except Exception as exc:
            logger.exception("step failed: failing the %d requests of its batch", batch.num_seqs)
            step.error = f"{type(exc).__name__}: {exc}"
        return step

    def _collect(self, step: DeviceStep) -> None:
        if step.error is not None:
            return
        assert step.launched is not None
        try:
            step.sampled = self.runner.collect(step.launched)
            step.scores = self.runner.collect_scores(step.launched)
        except Exception as exc:
            logger.exception("step failed: failing the requests of its batch")
            step.error = f"{type(exc).__name__}: {exc}"
