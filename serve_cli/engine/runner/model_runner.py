"""The device side of one engine step: xLLM-layout inputs -> one execute -> logits -> tokens."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from serve_cli.engine.kv_budget import default_num_blocks
from serve_cli.engine.runner.input_builder import InputBuilder, PreviousTokens, require_previous
from serve_cli.engine.runner.prompt_scores import PendingScores
from serve_cli.engine.runner.rank import build_executor, forward
from serve_cli.engine.runner.sampler import PendingSample, Sampler
from serve_cli.engine.runner.seen_tokens import SeenTokens

if TYPE_CHECKING:
    from serve_cli.engine.batch import ScheduledBatch
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.runner.tp_group import TPWorkers
    from serve_cli.engine.sampling import PromptLogprob, SamplingParams, TokenLogprobs
    from serve_cli.engine.served_model import ServedModel


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device whose tokens are not read back yet (``pending`` is None when
    it samples nothing, ``scores`` when it scores no prompt)."""

    sampled_request_ids: list[str]
    pending: PendingSample | None
    scores: PendingScores | None = None

    def previous_tokens(self) -> PreviousTokens | None:
        """Its sampled tokens as the next step's placeholders read them, on the device."""
        if self.pending is None:
            return None
        return PreviousTokens(self.sampled_request_ids, self.pending.tokens)


class ModelRunner:
    """Owns the platform, the model, its executor and KV cache, and runs one batch per ``run``.

    The cache is allocated and bound once: ``num_kv_blocks`` blocks, or what ``kv_cache_memory``
    bytes hold, or the default budget. ``run`` makes exactly one ``executor.execute`` call;
    ``launch`` + ``collect`` split it at the host sync, so that the engine can launch the next
    step (whose placeholders read this one's tokens on the device) before reading this one back.

    With ``tensor_parallel_size`` N > 1 this is rank 0 of N: it starts N-1 worker processes
    (``tp_group.TPWorkers``) that hold the other shards and mirror every step; the KV budget is
    per rank (each holds its share of the KV heads) and every rank binds the same block count.
    Only rank 0 samples; a step whose inputs hold the tokens of the step in flight (async
    scheduling) broadcasts them from rank 0 on the device first. With N = 1 no process or pipe is
    involved.
    """

    def __init__(self, served: ServedModel, config: EngineConfig) -> None:
        from serve_cli.engine.runner.platform_choice import serving_platform
        from xhal import platforms
        from xhal.executor import bytes_per_block
        from xhal.layers import TensorParallel

        self.platform = platforms.get(serving_platform(config.device))
        self.workers: TPWorkers | None = None
        collective = None
        if config.tensor_parallel_size > 1:
            from serve_cli.engine.runner import tp_group

            self.workers = tp_group.TPWorkers(self.platform, served, config)
            collective = self.workers.collective
        try:
            self.device = self.platform.device()
            tp = TensorParallel(0, config.tensor_parallel_size)
            self.executor = build_executor(self.platform, served, config, tp, collective)
            self.model = self.executor.model
            num_blocks = config.num_kv_blocks
            if num_blocks is None and config.kv_cache_memory is None:
                num_blocks = default_num_blocks(
                    self.platform,
                    bytes_per_block(self.executor.specs),
                    config.max_num_seqs,
                    self.executor.config.max_blocks_per_seq,
                )
            caches = self.executor.allocate_kv_caches(num_blocks, config.kv_cache_memory)
            self.executor.bind_kv_caches(caches)
            self.num_kv_blocks = caches[0].key.shape[0]
            self.kv_cache_bytes = self.num_kv_blocks * bytes_per_block(self.executor.specs)
            if self.workers is not None:
                self.workers.bind_kv_caches(self.num_kv_blocks)
            elif self.platform.device_type != "cpu":
                # capture every decode bucket now (progress bar; time and memory logged) so no
                # request pays for a capture; with TP all ranks would have to capture in step
                self.executor.capture_graphs()
                # and compile what a prefill needs (FlashInfer JIT: a minute on a fresh machine),
                # which the first request would otherwise wait for
                logger.info("prefill warm-up took %.1f s", self.executor.warm_up())
        except BaseException:
            self.close()
            raise
        self.dtype = self.executor.config.dtype
        self.input_builder = InputBuilder(
            self.device, self.platform.metadata_convention, config.block_size
        )
        self.sampler = Sampler(self.device, config.seed)

    def new_generator(self, seed: int) -> torch.Generator:
        """A request's own generator, for reproducible sampling with ``seed``."""
        return self.sampler.new_generator(seed)

    @staticmethod
    def new_seen_tokens(prompt_token_ids: list[int], blocked_token_ids: list[int]) -> SeenTokens:
        """A request's history, for sampling with a presence, frequency or repetition penalty,
        or with ``min_tokens`` holding ``blocked_token_ids`` back (``seen_tokens.py``)."""
        return SeenTokens(prompt_token_ids, blocked_token_ids)

    def run(
        self,
        batch: ScheduledBatch,
        params: Mapping[str, SamplingParams],
        generators: Mapping[str, torch.Generator | None],
        seen: Mapping[str, SeenTokens] | None = None,
    ) -> list[SampledToken]:
        """Run ``batch``; a token for each request whose chunk produces one, in batch order."""
        return self.collect(self.launch(batch, params, generators, seen=seen))

    def launch(
        self,
        batch: ScheduledBatch,
        params: Mapping[str, SamplingParams],
        generators: Mapping[str, torch.Generator | None],
        previous: LaunchedStep | None = None,
        seen: Mapping[str, SeenTokens] | None = None,
    ) -> LaunchedStep:
        """Queue ``batch``'s execute, logits and sampling on the device, its placeholders filled
        from ``previous`` (the step before, still in flight); nothing waits for the device.
        ``generators`` and ``seen`` hold the requests that have one (``new_generator``,
        ``new_seen_tokens``)."""
        step = self.input_builder.describe(batch)
        prev = None if previous is None else previous.previous_tokens()
        require_previous(step, prev)  # before any worker waits on a broadcast
        if self.workers is None:
            logits, scored = forward(self.executor, self.input_builder.upload(step, prev))
        else:
            workers = self.workers

            def local() -> tuple[torch.Tensor | None, torch.Tensor | None]:
                if step.placeholder_idxes:  # the workers fill theirs from rank 0's tokens
                    workers.collective.broadcast(prev.tokens, 0)
                return forward(self.executor, self.input_builder.upload(step, prev))

            logits, scored = workers.run_step(step, local)
        scores = None
        if scored is not None:
            targets = torch.from_numpy(step.prompt_targets)
            scores = PendingScores(scored, targets, step.scored_prompts, params)
        if logits is None:
            return LaunchedStep([], None, scores)
        rids = step.sampled_request_ids
        # the tokens where the next decode step's graph reads them, so it copies none; the
        # workers of a tensor-parallel group take int64 tokens by broadcast instead
        out = self.executor.token_ids(len(rids)) if self.workers is None else None
        histories = [seen.get(r) for r in rids] if seen else None
        pending = self.sampler.launch(
            logits, [params[r] for r in rids], [generators.get(r) for r in rids], out, histories
        )
        return LaunchedStep(rids, pending, scores)

    def collect(self, launched: LaunchedStep) -> list[SampledToken]:
        """Wait for ``launched``'s tokens (the step's one sync); one per sampled request."""
        if launched.pending is None:
            return []
        tokens, logprobs = launched.pending.resolve()
        return [SampledToken(*row) for row in zip(launched.sampled_request_ids, tokens, logprobs)]

    def collect_scores(self, launched: LaunchedStep) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """``launched``'s prompt scores: request id -> (first prompt position, entries)."""
        return {} if launched.scores is None else launched.scores.resolve()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()

