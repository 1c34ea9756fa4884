"""Rotary embedding of q and k in one launch, out of place, from int32 or int64 positions and a
float32 cos/sin table (one program per token and head; rotary_dim <= head_dim, the tail copied).

FlashInfer's kernel works in place and wants int64 positions; keeping our op's contract with it
took four extra launches per layer (two copies, two casts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_store(src, dst, cos, sin, i, m, D: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr):
    """Rotate one head's ``src`` into ``dst`` (NeoX or GPT-J pairs, float32 math, the dims past
    rotary_dim copied); ``rotary_kv.py`` stores k straight into the key cache with it."""
    if IS_NEOX:  # rotate halves: (x[i], x[i + HALF])
        first, second = i, i + HALF
    else:  # GPT-J: rotate interleaved pairs (x[2i], x[2i + 1])
        first, second = 2 * i, 2 * i + 1
    x1 = tl.load(src + first, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=m, other=0.0).to(tl.float32)
    out_ty = dst.dtype.element_ty
    tl.store(dst + first, (x1 * cos - x2 * sin).to(out_ty), mask=m)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(out_ty), mask=m)
    if BLOCK_TAIL > 0:  # partial rotary: dims past rotary_dim pass through
        t = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        mt = t < D
        tl.store(dst + t, tl.load(src + t, mask=mt, other=0.0), mask=mt)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < HQ:
        src = q_ptr + token * q_stride_t + head * q_stride_h
        dst = q_out_ptr + (token * HQ + head) * D
    else:
        src = k_ptr + token * k_stride_t + (head - HQ) * k_stride_h
        dst = k_out_ptr + (token * HK + (head - HQ)) * D
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=m, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + i, mask=m, other=0.0)
    rotate_store(src, dst, cos, sin, i, m, D, HALF, BLOCK_TAIL, IS_NEOX)


def rotation_args(
    cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool
) -> tuple[torch.Tensor, dict[str, object]]:
    """What a launch rotating with ``rotate_store`` takes: the table as float32 with a contiguous
    last dim (copied when it is not), and the rotation's constexprs (``D``, ``HALF``,
    ``BLOCK_HALF``, ``BLOCK_TAIL``: the dims past rotary_dim, ``IS_NEOX``)."""
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.float().contiguous()
    half = cos_sin_cache.shape[-1] // 2
    tail = head_dim - 2 * half
    return cos_sin_cache, dict(
        D=head_dim,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0,
        IS_NEOX=is_neox,
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, H, D]``, k ``[T, Hkv, D]`` (last dim contiguous), positions ``[T]``, cos_sin_cache
    float32 ``[max_position, rotary_dim]`` (cos | sin) -> new rotated q, k."""
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos_sin_cache, rotation = rotation_args(cos_sin_cache, d, is_neox)
    q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)  # contiguous
    if num_tokens:
        _rotary_kernel[(num_tokens, hq + hk)](
            positions,
            q,
            k,
            cos_sin_cache,
            q_out,
            k_out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            HQ=hq,
            HK=hk,
            **rotation,
            num_warps=1,
        )
    return q_out, k_out
