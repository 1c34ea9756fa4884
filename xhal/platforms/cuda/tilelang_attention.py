"""Paged attention with TileLang decode: decode batches run our TileLang kernel
(``kernels/tilelang_decode.py``), every other batch kind runs the backend it wraps.

Solution ``tilelang`` of paged decode attention. Requirements: CUDA (compute capability 8.0+),
fp16 / bf16, head dim 128, any block size, GQA group <= 64, no sliding window, no logits soft cap.
Prefill, chunked prefill and mixed batches go to the wrapped backend (the Triton fallback).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.cuda.decode_over_fallback import DecodeOverFallback, DecodePlan
from xhal.platforms.cuda.kernels import tilelang_decode
from xhal.platforms.cuda.kernels.kv_write import write_kv

HEAD_DIMS = (128,)
DTYPES = (torch.float16, torch.bfloat16)


def unsupported(spec: AttentionSpec) -> str | None:
    """Why the TileLang decode kernel cannot serve ``spec``, or None when it can."""
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype} (TileLang decode takes fp16 / bf16)"
    if spec.head_dim not in HEAD_DIMS:
        return f"head_dim {spec.head_dim} (TileLang decode is built for {HEAD_DIMS})"
    if spec.group_size > tilelang_decode.MAX_GROUP:
        return f"GQA group {spec.group_size} (at most {tilelang_decode.MAX_GROUP})"
    if spec.sliding_window is not None or spec.logits_soft_cap is not None:
        return "a sliding window or logits soft cap"
    return None


@dataclass
class _DecodePlan(DecodePlan):
    block_h: int  # rows of query heads per CTA, the compiled kernel's row tile


class TileLangAttention(DecodeOverFallback):
    """Decode on TileLang, the rest on ``fallback`` (an ``AttentionBackend`` of the same spec).

    The kernel is compiled here, when the backend is created, so no graph capture ever compiles.
    A decode plan keeps references to the metadata's device tensors and reads them at launch:
    for a graph bucket these are its persistent inputs (``DecodeOverFallback``), so a replay's
    plan queues no device work.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        fallback: AttentionBackend,
        num_sms: int,
        block_h: int | None = None,
    ) -> None:
        super().__init__(spec, fallback)
        reason = unsupported(spec)
        if reason is not None:
            raise ValueError(
                f"TileLangAttention cannot run {reason}; use the Triton or FlashInfer backend"
            )
        self.num_sms = num_sms
        # block_h: rows of query heads per CTA; None: chosen per step (see ``_row_tile``)
        if block_h is not None and (block_h not in (16, 64) or block_h < spec.group_size):
            raise ValueError(
                f"block_h={block_h}: give 16 or 64 rows, at least the GQA group {spec.group_size}"
            )
        self.block_h = block_h
        self._row_tile(2)  # compile the small-batch kernel now; ``plan`` compiles any other

    def plan_decode(self, m: AttentionMetadata, graph_key: Hashable | None) -> _DecodePlan:
        splits = tilelang_decode.num_splits(m.num_seqs, self.spec.num_kv_heads, self.num_sms)
        block_h = self._row_tile(splits)
        return _DecodePlan(
            m.num_seqs, m.block_table, m.kv_seq_lens, m.slot_mapping, splits, block_h
        )

    def _row_tile(self, splits: int) -> int:
        """The row tile of a step, compiled here (on the host, never under capture). Split
        batches use the smallest tile holding the group; unsplit ones (enough CTAs to fill the
        SMs) the 64-row Hopper warpgroup tile, which measured faster there (H200, 8B shape:
        211 vs 246 us at batch 64 x 2K, while 16 rows won at batch 16: 60 vs 87 us)."""
        s = self.spec
        block_h = self.block_h
        if block_h is None:
            block_h = (
                tilelang_decode.MAX_GROUP
                if splits == 1
                else tilelang_decode.block_rows(s.group_size)
            )
        tilelang_decode.compiled(s.head_dim, s.block_size, s.dtype, block_h)
        return block_h

    def decode(self, plan: _DecodePlan, layer_id: int, q, k, v) -> torch.Tensor:
        p, cache = plan, self._caches[layer_id]
        write_kv(k, v, cache.key, cache.value, p.slot_mapping)
        # q: [T, H, D], one row per sequence first, then padding rows (left zero)
        out = self.padded_output(q, p.num_seqs)
        # the kernel takes any row stride of q and the block table, not other strides
        rows = q[: p.num_seqs]
        if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
            rows = rows.contiguous()
        tilelang_decode.paged_decode(
            rows,
            cache.key,
            cache.value,
            self.unit_stride(p.block_table),
            self.unit_stride(p.kv_seq_lens),
            self.spec.softmax_scale,
            out[: p.num_seqs],
            p.splits,
            p.block_h,
        )
        return out
