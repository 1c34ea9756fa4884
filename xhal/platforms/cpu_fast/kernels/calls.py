"""Tensor-level calls into the native kernels. Each returns None when it does not serve the
call (no kernels built, or inputs that are not float32 rows laid out as the kernel reads them),
and the caller then runs its torch path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from xhal.platforms.cpu_fast.kernels.native import library

_F32 = torch.float32
_prefill_attention_on = True  # False inside ``sdpa_prefill()``


@contextlib.contextmanager
def sdpa_prefill() -> Iterator[None]:
    """Inside the block ``prefill_attention`` declines every call (torch's SDPA serves prefill
    chunks, as before the native kernel): for benchmarks that compare the two in one process."""
    global _prefill_attention_on
    saved, _prefill_attention_on = _prefill_attention_on, False
    try:
        yield
    finally:
        _prefill_attention_on = saved


def _rows(x: torch.Tensor) -> bool:
    """A 2-D float32 tensor of contiguous rows (CPU tensors only come here: cpu-fast serves the
    CPU). The norm's rows go to torch's threads past a decode batch's (``decode_kernels.c``)."""
    return x.dtype == _F32 and x.dim() == 2 and x.is_contiguous()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rms_norm(x + residual), x + residual)`` (``residual`` None: ``(rms_norm(x), x)``) for
    float32 rows ``[T, K]`` and a float32 weight ``[K]``."""
    lib = library()
    if (
        lib is None
        or not _rows(x)
        or weight.dtype != _F32
        or weight.shape != x.shape[1:]
        or not weight.is_contiguous()
        or (residual is not None and (not _rows(residual) or residual.shape != x.shape))
    ):
        return None
    rows, width = x.shape
    normed = torch.empty_like(x)
    if residual is None:
        lib.xhal_add_rms_norm(
            x.data_ptr(), None, weight.data_ptr(), eps, rows, width, normed.data_ptr(), None
        )
        return normed, x
    summed = torch.empty_like(x)
    lib.xhal_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, rows, width,
        normed.data_ptr(), summed.data_ptr(),
    )  # fmt: skip
    return normed, summed


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.argmax(dim=-1)`` (int64 ``[S]``: lowest index on ties, a row's first NaN if it
    has one) for float32 rows ``[S, V]`` with V >= 1 and unit column stride, any number of rows
    (reading them is the whole cost, single-threaded suffices)."""
    lib = library()
    if (
        lib is None
        or logits.dtype != _F32
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.stride(1) != 1
        or logits.stride(0) < logits.shape[1]
    ):
        return None
    rows, width = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.xhal_argmax_rows(logits.data_ptr(), rows, width, logits.stride(0), out.data_ptr())
    return out


def rotary_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slots: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` into ``out [T, H + Hkv, D]`` and write the
    rotated k and v ``[T, Hkv, D]`` to cache rows ``slots`` (int64 ``[T]``, -1 not written) of
    ``k_flat`` / ``v_flat [N, Hkv, D]``; False (nothing done) when the inputs are not float32
    with unit head and channel strides, int32 positions and a contiguous table no wider than a
    head."""
    lib = library()
    num_tokens, heads, dim = q.shape
    kv_strides = k.stride()
    if (
        lib is None
        or num_tokens == 0
        or q.dtype != _F32
        or k.dtype != _F32
        or v.dtype != _F32
        or k_flat.dtype != _F32
        or q.stride()[1:] != (dim, 1)
        or kv_strides[1:] != (dim, 1)
        or v.stride() != kv_strides
        or positions.dtype != torch.int32
        or positions.shape != (num_tokens,)
        or not positions.is_contiguous()
        or cos_sin_cache.dtype != _F32
        or not cos_sin_cache.is_contiguous()
        or cos_sin_cache.shape[1] > dim
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
    ):
        return False
    low, high = torch.aminmax(positions)  # the kernel reads table rows unchecked
    if int(low) < 0 or int(high) >= cos_sin_cache.shape[0]:
        return False  # the torch path raises its indexing error
    lib.xhal_rotary_write(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), kv_strides[0], num_tokens, heads,
        k.shape[1], dim, positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[1],
        is_neox, slots.data_ptr(), k_flat.data_ptr(), v_flat.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return True


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> bool:
    """Causal attention of one prefill chunk whose Lq queries are the last of its L keys (query i
    sees keys ``0 .. L - Lq + i``; L = Lq: no cached prefix): q ``[Lq, H, D]``, k / v ``[L, Hkv,
    D]`` into ``out [Lq, H, D]`` (contiguous); False (nothing done) unless all are float32 with
    unit head and channel strides, D a multiple of 32, H a multiple of Hkv and L >= Lq
    (``prefill_attention.c``)."""
    lib = library()
    num_queries, heads, dim = q.shape
    num_keys, kv_heads = k.shape[:2]
    if (
        lib is None
        or not _prefill_attention_on
        or num_queries == 0
        or dim % 32
        or heads % kv_heads
        or any(t.dtype != _F32 for t in (q, k, v, out))
        or any(t.stride()[1:] != (dim, 1) for t in (q, k, v))
        or k.shape != v.shape
        or num_keys < num_queries
        or k.shape[2] != dim
        or out.shape != q.shape
        or not out.is_contiguous()
    ):
        return False
    failed = lib.xhal_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        num_queries, num_keys, heads, kv_heads, dim, scale, out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("cpu-fast prefill attention: could not allocate its work buffers")
    return True
