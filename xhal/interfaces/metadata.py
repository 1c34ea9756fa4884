"""Per-step attention metadata: the normalized view every layer of a step shares."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class BatchKind(enum.IntEnum):
    """What a step's batch holds. Values are xLLM's ``BatchForwardType`` values."""

    PREFILL = 0  # every sequence starts from an empty KV cache
    CHUNKED_PREFILL = 1  # prompts continue over KV cached by earlier steps
    DECODE = 2  # one new token per sequence
    MIXED = 3  # decodes and prefill chunks together
    EMPTY = 4  # no tokens (an idle data-parallel rank)


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs, shared by every layer and every attention group.

    Field names follow xLLM's ``PyAttentionMetadataView``. Invariants callers rely on:

    - Sequence ``i``'s new tokens are rows ``q_cu_seq_lens[i]:q_cu_seq_lens[i+1]`` of q/k/v and
      sit at KV positions ``[kv_seq_lens[i] - q_seq_lens[i], kv_seq_lens[i])``; attention is
      causal aligned bottom-right (a new token sees every cached token and the new tokens up to
      itself). ``kv_seq_lens`` includes this step's tokens.
    - ``slot_mapping[t]`` is ``block_id * block_size + offset`` for token ``t``; ``-1`` marks a
      padding token whose K/V is never written and whose output row is unspecified.
    - Only the first ``ceil(kv_len / block_size)`` entries of a ``block_table`` row are
      meaningful. The rest are unspecified: 0 from hosts that pad with 0, stale but valid block
      ids in the executor's persistent decode tables (and in the rows of padding sequences).
    - ``*_host`` tensors live on the CPU and hold the same values as their device twins; they are
      what planners read, so no backend needs a device-to-host sync.
    - ``num_tokens`` may exceed ``q_cu_seq_lens[-1]`` when the executor pads a batch; the padding
      rows have slot ``-1``.
    """

    kind: BatchKind
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    q_cu_seq_lens: torch.Tensor  # int32 [B+1], leading 0, device
    kv_cu_seq_lens: torch.Tensor  # int32 [B+1], leading 0, device
    q_seq_lens: torch.Tensor  # int32 [B], device
    kv_seq_lens: torch.Tensor  # int32 [B], device
    q_seq_lens_host: torch.Tensor  # int32 [B], cpu
    kv_seq_lens_host: torch.Tensor  # int32 [B], cpu
    # int32 [B, max_blocks], device; entries past a row's pages unspecified
    block_table: torch.Tensor
    slot_mapping: torch.Tensor  # int32 [T], device
    paged_kv_indptr: torch.Tensor | None = None  # int32 [B+1], device
    paged_kv_indices: torch.Tensor | None = None  # int32 [nnz_pages], device
    paged_kv_last_page_len: torch.Tensor | None = None  # int32 [B], device
    # host twins of the paged-KV arrays (xLLM's CUDA builder emits them): FlashInfer plans on host
    paged_kv_indptr_host: torch.Tensor | None = None  # int32 [B+1], cpu
    paged_kv_last_page_len_host: torch.Tensor | None = None  # int32 [B], cpu

    @classmethod
    def from_host_lengths(
        cls,
        kind: BatchKind,
        q_seq_lens_host: torch.Tensor,
        kv_seq_lens_host: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        max_seq_len: int | None = None,
    ) -> AttentionMetadata:
        """The metadata of a step from its per-sequence host lengths (int32 CPU ``[B]``) and its
        device ``block_table`` and ``slot_mapping``: the cumulative and device length arrays are
        derived on the host and reach ``slot_mapping``'s device in one copy. ``max_seq_len``
        defaults to the longest ``kv`` (a graph capture states a larger one)."""
        q, kv = q_seq_lens_host, kv_seq_lens_host
        b = q.numel()
        zero = torch.zeros(1, dtype=torch.int32)
        packed = torch.cat(
            [zero, q.cumsum(0, dtype=torch.int32), zero, kv.cumsum(0, dtype=torch.int32), q, kv]
        )
        q_cu, kv_cu, q_dev, kv_dev = packed.to(slot_mapping.device).split([b + 1, b + 1, b, b])
        return cls(
            kind=BatchKind(kind),
            num_seqs=b,
            num_tokens=slot_mapping.shape[0],
            max_query_len=int(q.max()) if b else 0,
            max_seq_len=max_seq_len if max_seq_len is not None else int(kv.max()) if b else 0,
            q_cu_seq_lens=q_cu,
            kv_cu_seq_lens=kv_cu,
            q_seq_lens=q_dev,
            kv_seq_lens=kv_dev,
            q_seq_lens_host=q,
            kv_seq_lens_host=kv,
            block_table=block_table,
            slot_mapping=slot_mapping,
        )

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @property
    def is_prefill(self) -> bool:
        return self.kind == BatchKind.PREFILL

    @property
    def is_chunked_prefill(self) -> bool:
        return self.kind in (BatchKind.CHUNKED_PREFILL, BatchKind.MIXED)

    @property
    def is_decode(self) -> bool:
        return self.kind == BatchKind.DECODE

    @property
    def is_empty(self) -> bool:
        return self.kind == BatchKind.EMPTY

    def validate(self) -> None:
        """Check shapes, dtypes and host/device agreement; raise ``ValueError`` naming the field.

        Cheap checks only (shapes and host values); meant for tests and debug runs.
        """
        b = self.num_seqs
        expected = {
            "q_cu_seq_lens": (b + 1,),
            "kv_cu_seq_lens": (b + 1,),
            "q_seq_lens": (b,),
            "kv_seq_lens": (b,),
            "q_seq_lens_host": (b,),
            "kv_seq_lens_host": (b,),
            "slot_mapping": (self.num_tokens,),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"AttentionMetadata.{name} has shape {tuple(t.shape)}, expected {shape}"
                )
            if t.dtype != torch.int32:
                raise ValueError(
                    f"AttentionMetadata.{name} has dtype {t.dtype}, expected torch.int32"
                )
        for name in ("q_seq_lens_host", "kv_seq_lens_host"):
            if getattr(self, name).device.type != "cpu":
                raise ValueError(f"AttentionMetadata.{name} must be a CPU tensor")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != b:
            raise ValueError(
                f"AttentionMetadata.block_table has shape {tuple(self.block_table.shape)}, "
                f"expected [{b}, max_blocks]"
            )
        q, kv = self.q_seq_lens_host, self.kv_seq_lens_host
        if b and bool((q > kv).any()):
            raise ValueError("AttentionMetadata: a sequence has q_seq_len > kv_seq_len")
        if b and int(q.sum()) > self.num_tokens:
            raise ValueError(
                f"AttentionMetadata: q_seq_lens sum to {int(q.sum())} > "
                f"num_tokens={self.num_tokens}"
            )
