"""A minimal host for tests: each sequence gets blocks drawn from a shuffled pool (so block
tables are permuted and non-contiguous), and each step is built as AttentionMetadata."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from xhal.interfaces.metadata import AttentionMetadata, BatchKind


@dataclass
class _Seq:
    num_cached: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedHost:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[int, _Seq] = {}

    def step(
        self, chunks: list[tuple[int, list[int]]], pad_tokens: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``chunks``: (seq_id, new token ids) per sequence; ``pad_tokens`` extra rows get slot
        -1."""
        ids, positions, slots, q_lens, kv_lens, rows = [], [], [], [], [], []
        for seq_id, tokens in chunks:
            seq = self.seqs.setdefault(seq_id, _Seq())
            start, end = seq.num_cached, seq.num_cached + len(tokens)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            for pos in range(start, end):
                slots.append(
                    seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            positions += range(start, end)
            q_lens.append(len(tokens))
            kv_lens.append(end)
            rows.append(list(seq.blocks))
            seq.num_cached = end
        ids += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [-1] * pad_tokens
        width = max(len(r) for r in rows)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        q, kv = torch.tensor(q_lens, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32)
        if all(a == 1 for a in q_lens) and any(b > 1 for b in kv_lens):
            kind = BatchKind.DECODE
        elif q_lens == kv_lens:
            kind = BatchKind.PREFILL
        elif any(a == 1 for a in q_lens) and any(a > 1 for a in q_lens):
            kind = BatchKind.MIXED
        else:
            kind = BatchKind.CHUNKED_PREFILL
        metadata = AttentionMetadata.from_host_lengths(
            kind, q, kv, table, torch.tensor(slots, dtype=torch.int32)
        )
        metadata.validate()
        return (
            torch.tensor(ids, dtype=torch.int32),
            torch.tensor(positions, dtype=torch.int32),
            metadata,
        )
