"""Rotary embedding fused with the paged KV write: one launch rotates q (out of place), rotates k
straight into the key cache and copies v into the value cache at each token's slot (slot -1: not
written). It replaces the rotary launch and the KV-write launch of an attention layer; the
rotation is ``rotary.py``'s (NeoX or GPT-J pairs, float32 cos/sin table, partial rotary).

With programmatic dependent launch (``pdl.py``) a program reads the position, its cos / sin and
the slot (host-uploaded metadata and a constant table) before waiting for the projection that
produced q, k and v."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda import pdl
from xhal.platforms.cuda.kernels.rotary import rotate_store, rotation_args


@triton.jit
def _rotary_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cache_stride,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=m, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + i, mask=m, other=0.0)
    if USE_PDL:  # every program waits (pdl.py): q, k and v come from the kernel before
        slot = tl.load(slot_ptr + token).to(tl.int64)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if head < HQ:
        src = q_ptr + token * q_stride_t + head * q_stride_h
        rotate_store(
            src, q_out_ptr + (token * HQ + head) * D, cos, sin, i, m, D, HALF, BLOCK_TAIL, IS_NEOX
        )
    else:
        kv_head = head - HQ
        if not USE_PDL:
            slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # padding tokens (slot -1) are never written
            dst = slot * (HK * D) + kv_head * D  # caches: [num_blocks * block_size, HK, D]
            src = k_ptr + token * k_stride_t + kv_head * k_stride_h
            rotate_store(src, k_cache_ptr + dst, cos, sin, i, m, D, HALF, BLOCK_TAIL, IS_NEOX)
            d = tl.arange(0, BLOCK_D)
            md = d < D
            v = tl.load(v_ptr + token * v_stride_t + kv_head * v_stride_h + d, mask=md)
            tl.store(v_cache_ptr + dst + d, v, mask=md)


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    use_pdl: int | None = None,
) -> torch.Tensor:
    """Rotated q ``[T, H, D]`` (new, contiguous); rotated k and v written into the contiguous
    caches ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` (-1 skipped). q, k, v may be
    strided (last dim contiguous or copied); positions int32 / int64 ``[T]``; cos_sin_cache
    float32 ``[max_position, rotary_dim]``. Any CUDA GPU Triton runs on; graph-safe once
    compiled. ``use_pdl``: ``pdl.small_kernel(q.device)`` when None (the attention backends'
    calls)."""
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[-2:] != (hk, d):
        raise ValueError(
            f"rotary_write_kv: caches must be contiguous [..., {hk}, {d}], got "
            f"{tuple(k_cache.shape)}"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos_sin_cache, rotation = rotation_args(cos_sin_cache, d, is_neox)
    q_out = q.new_empty(q.shape)
    use_pdl = pdl.small_kernel(q.device) if use_pdl is None else int(bool(use_pdl))
    if num_tokens:
        _rotary_kv_kernel[(num_tokens, hq + hk)](
            positions,
            q,
            k,
            v,
            cos_sin_cache,
            q_out,
            k_cache,
            v_cache,
            slot_mapping,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos_sin_cache.stride(0),
            HQ=hq,
            HK=hk,
            BLOCK_D=triton.next_power_of_2(d),
            USE_PDL=use_pdl,
            **rotation,
            num_warps=1,
            **pdl.launch_options(use_pdl),
        )
    return q_out
