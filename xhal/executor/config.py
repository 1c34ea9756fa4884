"""Executor configuration: frozen, with derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExecutorConfig:
    """How the executor runs a model.

    Graph buckets: ``decode_graph_sizes`` chooses the batch sizes decode graphs are captured for
    and ``decode_capture_sizes`` is what is used: those sizes sorted and deduplicated, or by
    default 1, 2, 4, 8 then steps of 16 up to ``max_num_seqs``. A decode batch of B sequences
    replays the smallest bucket >= B, padded with rows that carry slot -1 and never change real
    rows. Likewise ``piecewise_token_sizes`` chooses the token buckets of piecewise graphs for
    prefill and mixed batches (all but attention captured) and ``token_capture_sizes`` is what is
    used. ``max_model_len`` fixes the width of the static block table a captured graph reads.
    """

    dtype: torch.dtype = torch.float32
    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enforce_eager: bool = False
    # batch buckets of decode graphs; None: the default (see decode_capture_sizes)
    decode_graph_sizes: tuple[int, ...] | None = None
    # token buckets of piecewise graphs (prefill / mixed); () turns them off
    piecewise_token_sizes: tuple[int, ...] | None = None
    max_num_batched_tokens: int = 2048
    metadata_convention: str = "cuda"  # layout of xLLM views handed to execute(): "cuda" or "npu"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_model_len <= 0:
            raise ValueError(f"ExecutorConfig needs positive sizes, got {self}")
        if self.metadata_convention not in ("cuda", "npu"):
            raise ValueError(
                f"metadata_convention must be 'cuda' or 'npu', got {self.metadata_convention!r}"
            )

    @property
    def decode_capture_sizes(self) -> tuple[int, ...]:
        """The decode graphs' batch buckets, ascending."""
        if self.decode_graph_sizes is not None:
            return tuple(sorted(set(self.decode_graph_sizes)))
        sizes = [s for s in (1, 2, 4, 8) if s <= self.max_num_seqs]
        sizes += range(16, self.max_num_seqs + 1, 16)
        if sizes[-1] != self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return tuple(sizes)

    @property
    def token_capture_sizes(self) -> tuple[int, ...]:
        """Default: powers of two from 16 up to ``max_num_batched_tokens`` (and it)."""
        if self.piecewise_token_sizes is not None:
            return tuple(sorted(set(self.piecewise_token_sizes)))
        sizes, s = [], 16
        while s < self.max_num_batched_tokens:
            sizes.append(s)
            s *= 2
        return (*sizes, self.max_num_batched_tokens)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
