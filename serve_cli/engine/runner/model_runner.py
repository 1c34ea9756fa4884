"""The device side of one engine step: xLLM-layout inputs -> one execute -> logits -> tokens."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from serve_cli.engine.kv_budget import default_num_blocks
from serve_cli.engine.runner.input_builder import InputBuilder
from serve_cli.engine.runner.rank import build_executor, forward
from serve_cli.engine.runner.sampler import Sampler

if TYPE_CHECKING:
    from serve_cli.engine.batch import ScheduledBatch
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.runner.tp_group import TPWorkers
    from serve_cli.engine.sampling import SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None


class ModelRunner:
    """Owns the platform, the model, its executor and KV cache, and runs one batch per ``run``.

    The cache is allocated and bound once: ``num_kv_blocks`` blocks, or what ``kv_cache_memory``
    bytes hold, or the default budget. ``run`` makes exactly one ``executor.execute`` call.

    With ``tensor_parallel_size`` N > 1 this is rank 0 of N: it starts N-1 worker processes
    (``tp_group.TPWorkers``) that hold the other shards and mirror every step; the KV budget is
    per rank (each holds its share of the KV heads) and every rank binds the same block count.
    Only rank 0 samples. With N = 1 no process or pipe is involved.
    """

    def __init__(self, model_dir: Path, config: EngineConfig, max_model_len: int) -> None:
        from xhal import platforms
        from xhal.executor import bytes_per_block
        from xhal.layers import TensorParallel

        self.platform = platforms.get(config.device)
        self.workers: TPWorkers | None = None
        collective = None
        if config.tensor_parallel_size > 1:
            from serve_cli.engine.runner import tp_group

            self.workers = tp_group.TPWorkers(self.platform, model_dir, config, max_model_len)
            collective = self.workers.collective
        try:
            self.device = self.platform.device()
            tp = TensorParallel(0, config.tensor_parallel_size)
            self.executor = build_executor(
                self.platform, model_dir, config, max_model_len, tp, collective
            )
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
            if self.workers is not None:
                self.workers.bind_kv_caches(self.num_kv_blocks)
        except BaseException:
            self.close()
            raise
        self.dtype = self.executor.config.dtype
        self.input_builder = InputBuilder(
            self.device, config.metadata_convention, config.block_size
        )
        self.sampler = Sampler(self.device, config.seed)

    def new_generator(self, seed: int) -> torch.Generator:
        """A request's own generator, for reproducible sampling with ``seed``."""
        return self.sampler.new_generator(seed)

    def run(
        self,
        batch: ScheduledBatch,
        params: Mapping[str, SamplingParams],
        generators: Mapping[str, torch.Generator | None],
    ) -> list[SampledToken]:
        """Run ``batch``; a token for each request whose chunk produces one, in batch order."""
        step = self.input_builder.describe(batch)
        if self.workers is None:
            logits = forward(self.executor, self.input_builder.upload(step))
        else:
            logits = self.workers.run_step(
                step, lambda: forward(self.executor, self.input_builder.upload(step))
            )
        if logits is None:
            return []
        rids = step.sampled_request_ids
        tokens, logprobs = self.sampler.sample(
            logits, [params[r] for r in rids], [generators.get(r) for r in rids]
        )
        return [SampledToken(*row) for row in zip(rids, tokens, logprobs)]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()

