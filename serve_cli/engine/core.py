"""The engine: one scheduler batch -> one model step -> sampled tokens -> text deltas."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_cli.engine import kv_budget
from serve_cli.engine.batch import ScheduledBatch
from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.config import EngineConfig
from serve_cli.engine.detokenizer import IncrementalDetokenizer
from serve_cli.engine.errors import ParamError
from serve_cli.engine.output import RequestOutput
from serve_cli.engine.request import Request, RequestStatus
from serve_cli.engine.sampling import SamplingParams, TokenLogprobs
from serve_cli.engine.scheduler import Scheduler
from serve_cli.histogram import Histogram

if TYPE_CHECKING:
    from serve_cli.engine.runner.model_runner import LaunchedStep, SampledToken

logger = logging.getLogger(__name__)
# vLLM's buckets of its iteration-tokens histogram
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class _State:
    """What the engine keeps per live request beside the scheduler's ``Request``."""

    request: Request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: Any  # the runner's RNG for a seeded request, else None
    scheduled_at: float | None = None  # time.monotonic() of its first scheduled step


@dataclass
class _Step:
    """A scheduled batch on its way through the device: ``launched`` once queued there, or
    ``error`` when queuing it failed. ``states`` are its requests' states when it was scheduled;
    a request whose state is gone (or replaced) since has its results dropped."""

    batch: ScheduledBatch
    states: dict[str, _State] = field(default_factory=dict)
    launched: LaunchedStep | None = None
    error: str | None = None

    def is_live(self, rid: str, states: dict[str, _State]) -> bool:
        return states.get(rid) is self.states[rid]


class EngineCore:
    """Owns the tokenizer, the scheduler with its KV block manager, the model runner (model,
    executor, KV cache) and each live request's output state.

    Single-threaded: call ``add_request`` / ``abort`` / ``step`` from one loop. Each ``step``
    schedules one batch and runs it with one ``executor.execute`` (+ ``compute_logits`` and
    sampling for the rows that produce a token), then returns a ``RequestOutput`` per request that
    got a token or finished. A failing step fails only its batch's requests (reason "error", with a
    logged traceback) and frees their blocks; the engine keeps serving.

    With ``config.async_scheduling`` a ``step`` schedules and launches step N+1 first (the
    requests step N samples for feed placeholders, filled on the device from step N's tokens),
    then reads step N back (its one sync), detokenizes, checks stops and advances the scheduler
    for it, and returns step N's outputs; step N+1 stays in flight until the next ``step``. A
    request that finishes at step N has its step N+1 row dropped; its blocks are freed once step
    N+1 is read back. Results are the same as without it; outputs come one ``step`` call later.

    With ``tensor_parallel_size`` N > 1 this process is rank 0 and the runner owns N-1 worker
    processes: call ``close`` to stop them (they also die with this process). A step that fails
    on any rank fails its batch; the workers are then stopped and later steps fail too.
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from models.loader import read_config
        from serve_cli.default_model import ensure_default_model
        from serve_cli.engine.runner.model_runner import ModelRunner

        self.config = config
        self.model_dir = Path(config.model_dir) if config.model_dir else ensure_default_model()
        model_config = read_config(self.model_dir)
        self.max_model_len = self._max_model_len(model_config)
        self.vocab_size = int(model_config["vocab_size"])
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.eos_token_ids = self._eos_token_ids(model_config)
        self.runner = ModelRunner(self.model_dir, config, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            async_scheduling=bool(config.async_scheduling),
        )
        self._states: dict[str, _State] = {}
        self._pending: list[RequestOutput] = []  # abort outputs, returned by the next step
        self._in_flight: _Step | None = None  # async scheduling: launched, not read back yet
        self._counters = dict(
            prompt_tokens_total=0, generation_tokens_total=0, num_preemptions_total=0
        )
        self._iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        logger.info(
            "engine ready: %s on %s (%s, tensor-parallel size %d, %s), KV cache %s, "
            "max_model_len %d",
            self.model_dir, config.device, self.runner.dtype, config.tensor_parallel_size,
            "eager" if config.enforce_eager else "graphs",
            kv_budget.describe(
                self.runner.num_kv_blocks,
                self.runner.kv_cache_bytes // self.runner.num_kv_blocks,
                config.block_size,
            ),
            self.max_model_len,
        )

    def close(self) -> None:
        """Release what outlives a plain object: the tensor-parallel worker processes."""
        self.runner.close()

    def _max_model_len(self, model_config: dict[str, Any]) -> int:
        limit = model_config.get("max_position_embeddings")
        wanted = self.config.max_model_len or limit or 2048
        if limit is not None and wanted > limit:
            raise ValueError(
                f"max_model_len ({wanted}) exceeds the model's max_position_embeddings ({limit}); "
                "lower max_model_len"
            )
        return int(wanted)

    def _eos_token_ids(self, model_config: dict[str, Any]) -> frozenset[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer, all together."""
        sources = [model_config.get("eos_token_id"), self.tokenizer.eos_token_id]
        generation = self.model_dir / "generation_config.json"
        if generation.is_file():
            sources.append(json.loads(generation.read_text()).get("eos_token_id"))
        ids: set[int] = set()
        for value in sources:
            values = value if isinstance(value, list) else [value]
            ids.update(v for v in values if isinstance(v, int))
        return frozenset(ids)

    # requests ----------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request. Raises ``ParamError`` (a ``ValueError`` whose ``param`` names the field)
        for a bad id, prompt or sampling parameter, and ``ValueError`` for a request the whole KV
        cache could never hold."""
        if not isinstance(request_id, str) or not request_id:
            raise ParamError("request_id", f"must be a non-empty string, got {request_id!r}")
        if request_id in self._states:
            raise ParamError("request_id", f"{request_id!r} is already used by a live request")
        if not isinstance(params, SamplingParams):
            raise ParamError("params", f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        prompt = self._check_prompt(prompt_token_ids)
        request = Request(request_id, prompt, params.max_tokens, sampling_params=params)
        self.scheduler.submit(request)
        generator = None if params.seed is None else self.runner.new_generator(params.seed)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, params.stop)
        self._states[request_id] = _State(request, params, detokenizer, generator)

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ParamError("prompt", "needs at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ParamError("prompt", "token ids must be integers")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ParamError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if len(prompt) > self.max_model_len:
            raise ParamError(
                "prompt",
                f"has {len(prompt)} tokens, more than max_model_len ({self.max_model_len})",
            )
        return prompt

    def abort(self, request_id: str) -> bool:
        """Finish a live request as "abort" and free its blocks now; its last output comes with
        the next ``step``. Returns False for an unknown or finished request."""
        state = self._states.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        self._pending.append(self._output(state, finish_reason="abort"))
        self._settle()
        return True

    def has_unfinished(self) -> bool:
        """Whether ``step`` has work or outputs left."""
        return bool(self._states) or bool(self._pending) or self._in_flight is not None

    # one step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of the requests that got a token or finished (with
        async scheduling: launch the next batch, then return the outputs of the one before)."""
        outputs, self._pending = self._pending, []
        previous, self._in_flight = self._in_flight, None
        current = self._launch_next(previous)  # step N+1, before step N is read back
        if current is not None and current.error is None and self.config.async_scheduling:
            self._in_flight, current = current, None  # read back by the next step()
        if previous is not None:
            outputs += self._complete(previous)
        if current is not None:  # without overlap (or when its launch failed): read it now
            outputs += self._complete(current)
        self._settle()
        outputs, self._pending = outputs + self._pending, []
        return outputs

    def _settle(self) -> None:
        """Read back a step in flight at once when every request in it has finished since: it
        holds their blocks, and nothing it computed is wanted."""
        step = self._in_flight
        if step is not None and not any(step.is_live(rid, self._states) for rid in step.states):
            self._in_flight = None
            self._pending += self._complete(step)  # no outputs: every row is dropped

    def _launch_next(self, previous: _Step | None) -> _Step | None:
        """Schedule the next batch and queue it on the device (None when nothing is runnable)."""
        batch = self.scheduler.next_batch()
        if batch is None:
            return None
        self._counters["num_preemptions_total"] += len(batch.preempted_ids)
        self._iteration_tokens.observe(batch.num_tokens)
        step = _Step(batch, {s.request_id: self._states[s.request_id] for s in batch.requests})
        now = time.monotonic()
        for state in step.states.values():
            if state.scheduled_at is None:
                state.scheduled_at = now
        try:
            params = {rid: s.params for rid, s in step.states.items()}
            generators = {
                rid: s.generator for rid, s in step.states.items() if s.generator is not None
            }
            prior = None if previous is None else previous.launched
            step.launched = self.runner.launch(batch, params, generators, prior)
        except Exception as exc:
            logger.exception("step failed: failing the %d requests of its batch", batch.num_seqs)
            step.error = f"{type(exc).__name__}: {exc}"
        return step

    def _complete(self, step: _Step) -> list[RequestOutput]:
        """Read ``step``'s tokens back (its one sync) and turn them into outputs."""
        if step.error is None:
            assert step.launched is not None
            try:
                sampled = self.runner.collect(step.launched)
            except Exception as exc:
                logger.exception("step failed: failing the requests of its batch")
                step.error = f"{type(exc).__name__}: {exc}"
        if step.error is not None:
            return self._fail_batch(step, step.error)
        return self._postprocess(step, sampled)

    def _fail_batch(self, step: _Step, error: str) -> list[RequestOutput]:
        live = [rid for rid in step.states if step.is_live(rid, self._states)]
        failed = {rid: RequestStatus.FINISHED_ERROR for rid in live}
        self.scheduler.advance(step.batch, {}, failed)
        states = [self._states.pop(rid) for rid in live]
        return [self._output(s, finish_reason="error", error=error) for s in states]

    def _postprocess(self, step: _Step, sampled: list[SampledToken]) -> list[RequestOutput]:
        sampled = [s for s in sampled if step.is_live(s.request_id, self._states)]
        texts: dict[str, str] = {}
        finished: dict[str, RequestStatus] = {}
        errors: dict[str, str] = {}
        stop_reasons: dict[str, int | str | None] = {}
        for s in sampled:
            state = self._states[s.request_id]
            try:
                texts[s.request_id] = state.detokenizer.add_token(s.token_id)
            except Exception as exc:  # a tokenizer failure fails its request, not the engine
                logger.exception("detokenizing request %s failed", s.request_id)
                errors[s.request_id] = f"{type(exc).__name__}: {exc}"
                finished[s.request_id] = RequestStatus.FINISHED_ERROR
                continue
            params = state.params
            eos = s.token_id in self.eos_token_ids and not params.ignore_eos
            if s.token_id in params.stop_token_ids and not eos:
                stop_reasons[s.request_id] = s.token_id
            elif state.detokenizer.stopped:
                stop_reasons[s.request_id] = state.detokenizer.matched_stop
            if eos or s.request_id in stop_reasons:
                finished[s.request_id] = RequestStatus.FINISHED_STOPPED
        tokens = {s.request_id: s.token_id for s in sampled}
        done = {r.request_id for r in self.scheduler.advance(step.batch, tokens, finished)}

        outputs = []
        for s in sampled:
            rid = s.request_id
            state = self._states.pop(rid) if rid in done else self._states[rid]
            if rid in errors:
                outputs.append(self._output(state, finish_reason="error", error=errors[rid]))
                continue
            self._counters["generation_tokens_total"] += 1
            if state.request.num_output_tokens == 1:  # the prompt is fully processed
                self._counters["prompt_tokens_total"] += state.request.num_prompt_tokens
            text, reason = texts[rid], None
            if rid in done:
                text += state.detokenizer.flush()
                reason = "stop" if state.detokenizer.stopped else state.request.finish_reason
            logprobs = None if s.logprobs is None else [s.logprobs]
            output = self._output(state, [s.token_id], text, reason, logprobs)
            if reason == "stop":
                output.stop_reason = stop_reasons.get(rid)
            outputs.append(output)
        return outputs

    def _output(
        self,
        state: _State,
        new_token_ids: list[int] | None = None,
        new_text: str = "",
        finish_reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        request = state.request
        if logprobs is None and state.params.logprobs is not None:
            logprobs = []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids or [],
            new_text=new_text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            error=error,
            scheduled_at=state.scheduled_at,
        )

    # introspection and the offline helper -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for metrics; prefix-cache and token counts are in tokens."""
        bm = self.block_manager
        return dict(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            iteration_tokens=self._iteration_tokens.to_dict(),
            **self._counters,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Run ``prompts`` concurrently to completion and return their output token ids, in order
        (an offline helper for tests and scripts). Raises ``RuntimeError`` if any request fails."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        tag = uuid.uuid4().hex[:8]
        ids = [f"generate-{tag}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, per_prompt):
            self.add_request(rid, prompt, p)
        remaining = set(ids)
        while remaining:
            for out in self.step():
                if out.request_id not in remaining:
                    continue
                results[out.request_id] += out.new_token_ids
                if out.finished:
                    remaining.discard(out.request_id)
                    if out.finish_reason == "error":
                        for rid in remaining:
                            self.abort(rid)
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return [results[rid] for rid in ids]
