"""The step's ``BatchKind``: from xLLM's ``batch_forward_type`` when given, else from flags and
host lengths (never from device tensors)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from xhal.interfaces.metadata import BatchKind


def parse_batch_forward_type(value: Any) -> BatchKind:
    """A ``BatchKind`` from itself, its int value (xLLM ``BatchForwardType``) or its name."""
    if isinstance(value, BatchKind):
        return value
    if isinstance(value, str) and value.upper() in BatchKind.__members__:
        return BatchKind[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return BatchKind(value)
        except ValueError:
            pass
    known = ", ".join(f"{k.name}={k.value}" for k in BatchKind)
    raise ValueError(f"metadata field batch_forward_type is {value!r}, expected one of {known}")


def derive_kind(
    q_lens: torch.Tensor | np.ndarray,
    kv_lens: torch.Tensor | np.ndarray,
    *,
    is_prefill: bool = False,
    is_chunked_prefill: bool = False,
) -> BatchKind:
    """Classify a batch from per-sequence host lengths ``[B]`` (CPU tensors or numpy arrays).

    EMPTY when B == 0; DECODE when every q_len is 1 and no prefill flag is set; PREFILL when
    q_len == kv_len for every sequence (no cached KV); MIXED when decodes (q_len 1 over cached KV)
    sit next to prefill chunks (q_len > 1); else CHUNKED_PREFILL. The flags only settle what the
    lengths cannot: a batch of one-token prompts is PREFILL under ``is_prefill``, DECODE otherwise.
    """
    if len(q_lens) == 0:
        return BatchKind.EMPTY
    if not (is_prefill or is_chunked_prefill) and bool((q_lens == 1).all()):
        return BatchKind.DECODE
    if bool((q_lens == kv_lens).all()):
        return BatchKind.PREFILL
    decodes = (q_lens == 1) & (kv_lens > 1)
    if bool(decodes.any()) and bool((q_lens > 1).any()):
        return BatchKind.MIXED
    return BatchKind.CHUNKED_PREFILL


def kind_without_q_lens(
    num_seqs: int, batch_forward_type: Any, is_prefill: Any, is_chunked_prefill: Any
) -> BatchKind:
    """The kind when the host gave no ``q_seq_lens_host`` (xLLM's view does not expose it).

    Only an explicit statement is trusted (``batch_forward_type``, or both flags given): guessing
    DECODE for a prefill would change numerics.
    """
    if batch_forward_type is not None:
        return parse_batch_forward_type(batch_forward_type)
    if num_seqs == 0:
        return BatchKind.EMPTY
    if is_prefill is None or is_chunked_prefill is None:
        raise ValueError(
            "metadata field q_seq_lens_host is missing and neither batch_forward_type nor both "
            "is_prefill and is_chunked_prefill are given: pass q_seq_lens_host (device tensors "
            "are never read back to the host)"
        )
    if is_prefill:
        return BatchKind.PREFILL
    if is_chunked_prefill:
        raise ValueError(
            "metadata field q_seq_lens_host is required for a chunked-prefill or mixed batch "
            "(per-sequence query lengths cannot be inferred from the flags)"
        )
    return BatchKind.DECODE


def check_kind(kind: BatchKind, q_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """Reject a stated kind that the host lengths contradict where backends rely on it."""
    if kind == BatchKind.DECODE and q_lens.numel() and not bool((q_lens == 1).all()):
        raise ValueError(
            f"batch_forward_type is DECODE but q_seq_lens are {q_lens.tolist()}, expected all 1"
        )
    if kind == BatchKind.PREFILL and not bool((q_lens == kv_lens).all()):
        raise ValueError(
            f"batch_forward_type is PREFILL (no cached KV) but q_seq_lens {q_lens.tolist()} != "
            f"kv_seq_lens {kv_lens.tolist()}; use CHUNKED_PREFILL"
        )


def resolve_kind(
    num_seqs: int,
    q_lens: torch.Tensor | None,
    kv_lens: torch.Tensor,
    batch_forward_type: Any,
    is_prefill: Any,
    is_chunked_prefill: Any,
) -> tuple[BatchKind, torch.Tensor]:
    """The step's kind and per-sequence host query lengths, inferring the latter when absent."""
    if q_lens is not None:
        if batch_forward_type is not None:
            return parse_batch_forward_type(batch_forward_type), q_lens
        flags = {"is_prefill": bool(is_prefill), "is_chunked_prefill": bool(is_chunked_prefill)}
        return derive_kind(q_lens, kv_lens, **flags), q_lens
    kind = kind_without_q_lens(num_seqs, batch_forward_type, is_prefill, is_chunked_prefill)
    if kind == BatchKind.PREFILL:
        return kind, kv_lens  # no cached KV: every token of each sequence is new
    if kind == BatchKind.DECODE or num_seqs == 0:
        return kind, torch.ones(num_seqs, dtype=torch.int32)
    raise ValueError(f"metadata field q_seq_lens_host is required for a {kind.name} batch")
