"""The engine: one scheduler batch -> one model step -> sampled token ids per request."""

from __future__ import annotations

import logging
from typing import Any

from serve_cli.engine import kv_budget
from serve_cli.engine.admission import admit
from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.config import EngineConfig
from serve_cli.engine.output import RequestOutput
from serve_cli.engine.postprocess import PostProcessor
from serve_cli.engine.request import Request
from serve_cli.engine.request_state import RequestState
from serve_cli.engine.sampling import SamplingParams
from serve_cli.engine.scheduler import Scheduler
from serve_cli.engine.served_model import ServedModel
from serve_cli.engine.step_pipeline import StepPipeline

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler with its KV block manager, the model runner (model, executor, KV cache)
    and each live request's state; composes model discovery (``served_model``), admission
    (``admission``), the device pipeline (``step_pipeline``) and post-processing (``postprocess``).

    Single-threaded: call ``add_request`` / ``abort`` / ``step`` from one loop. Each ``step``
    schedules one batch and runs it with one ``executor.execute`` (+ ``compute_logits`` and
    sampling for the rows that produce a token), then returns a ``RequestOutput`` per request that
    got a token or finished: token ids only, no text (``OutputProcessor`` turns them into text and
    applies stop strings, in the API process). A failing step fails only its batch's requests
    (reason "error", with a logged traceback) and frees their blocks; the engine keeps serving.

    With ``config.schedules_async`` a ``step`` launches step N+1 before reading step N back and
    returns step N's outputs (see ``step_pipeline``). A request that finishes at step N has its
    step N+1 row dropped; its blocks are freed once step N+1 is read back. Results are the same as
    without it; outputs come one ``step`` call later.

    With ``tensor_parallel_size`` N > 1 this process is rank 0 and the runner owns N-1 worker
    processes: call ``close`` to stop them (they also die with this process). A step that fails
    on any rank fails its batch; the workers are then stopped and later steps fail too.
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from serve_cli.engine.runner.model_runner import ModelRunner

        self.config = config
        self.model = ServedModel.discover(config)
        self.model_dir = self.model.directory
        self.max_model_len = self.model.max_model_len
        self.vocab_size = self.model.vocab_size
        # the engine reads only EOS ids from it; text is made in the API process
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.runner = ModelRunner(self.model, config)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            async_scheduling=config.schedules_async,
        )
        self.pipeline = StepPipeline(self.runner, self.scheduler, config.schedules_async)
        self.postprocessor = PostProcessor(
            self.scheduler, self.model.eos_token_ids(self.tokenizer)
        )
        self._states: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []  # abort outputs, returned by the next step
        logger.info(
            "engine ready: %s on %s (%s, tensor-parallel size %d, %s), KV cache %s, "
            "max_model_len %d",
            self.model_dir, config.device, self.runner.dtype, config.tensor_parallel_size,
            "eager" if config.runs_eager else "graphs",
            kv_budget.describe(
                self.runner.num_kv_blocks,
                self.runner.kv_cache_bytes // self.runner.num_kv_blocks,
                config.block_size,
            ),
            self.max_model_len,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.postprocessor.eos_token_ids

    def close(self) -> None:
        """Release what outlives a plain object: the tensor-parallel worker processes."""
        self.runner.close()

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request. Raises ``ParamError`` (a ``ValueError`` whose ``param`` names the field)
        for a bad id, prompt or parameters object, and ``ValueError`` for a request the whole KV
        cache could never hold."""
        prompt = admit(request_id, prompt_token_ids, params, self._states, self.model)
        scores = params.prompt_logprobs is not None
        request = Request(
            request_id, prompt, params.max_tokens, sampling_params=params, scores_prompt=scores
        )
        self.scheduler.submit(request)
        generator = None if params.seed is None else self.runner.new_generator(params.seed)
        seen = None
        if params.needs_history:  # min_tokens holds back what would end the output early
            eos = () if params.ignore_eos or not params.min_tokens else self.eos_token_ids
            stops = params.stop_token_ids if params.min_tokens else ()
            seen = self.runner.new_seen_tokens(prompt, sorted({*eos, *stops}))
        state = RequestState(request, params, generator, seen=seen)
        if scores:
            state.prompt_logprobs = [None]  # the first prompt token has nothing before it
        self._states[request_id] = state

    def abort(self, request_id: str) -> bool:
        """Finish a live request as "abort" and free its blocks now; its last output comes with
        the next ``step``. Returns False for an unknown or finished request."""
        state = self._states.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        self._pending.append(state.output(finish_reason="abort"))
        self._settle()
        return True

    def has_unfinished(self) -> bool:
        """Whether ``step`` has work or outputs left."""
        return bool(self._states) or bool(self._pending) or self.pipeline.in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of the requests that got a token or finished (with
        async scheduling: launch the next batch, then return the outputs of the one before)."""
        outputs, self._pending = self._pending, []
        for done in self.pipeline.advance(self._states):
            outputs += self.postprocessor.outputs(done, self._states)
        self._settle()
        outputs, self._pending = outputs + self._pending, []
        return outputs

    def _settle(self) -> None:
        step = self.pipeline.settle(self._states)
        if step is not None:
            self._pending += self.postprocessor.outputs(step, self._states)  # every row dropped

    @property
    def _in_flight(self) -> Any:
        """The step launched and not read back yet (tests check that none is left)."""
        return self.pipeline.in_flight

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for metrics; prefix-cache and token counts are in tokens."""
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "iteration_tokens": self.pipeline.iteration_tokens.to_dict(),
            "prompt_tokens_total": self.postprocessor.prompt_tokens_total,
            "generation_tokens_total": self.postprocessor.generation_tokens_total,
            "num_preemptions_total": self.pipeline.num_preemptions,
        }
