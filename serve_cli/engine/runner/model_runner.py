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
from serve_cli.engine.runner.sampler import Sampler

if TYPE_CHECKING:
    from serve_cli.engine.batch import ScheduledBatch
    from serve_cli.engine.config import EngineConfig
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
    """

    def __init__(self, model_dir: Path, config: EngineConfig, max_model_len: int) -> None:
        from models.loader import load_model
        from xhal import platforms
        from xhal.executor import ExecutorConfig, ModelExecutor, bytes_per_block

        self.platform = platforms.get(config.device)
        self.device = self.platform.device()
        self.model = load_model(model_dir, config.dtype, self.device)
        self.executor = ModelExecutor(
            self.model,
            self.platform,
            ExecutorConfig(
                dtype=next(self.model.parameters()).dtype,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
                enforce_eager=config.enforce_eager,
                metadata_convention=config.metadata_convention,
            ),
        )
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
        inputs = self.input_builder.build(batch)
        hidden = self.executor.execute(inputs.input_ids, inputs.positions, inputs.metadata)
        rids = inputs.sampled_request_ids
        if not rids:
            return []
        logits = self.executor.compute_logits(hidden, inputs.selected_idxes)  # [S, vocab]
        tokens, logprobs = self.sampler.sample(
            logits, [params[r] for r in rids], [generators.get(r) for r in rids]
        )
        return [SampledToken(*row) for row in zip(rids, tokens, logprobs)]
