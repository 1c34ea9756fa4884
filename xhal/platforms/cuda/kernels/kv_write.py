"""Paged KV write by slot mapping that skips slot -1: one launch, no host sync, graph-safe."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    src_stride, ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: never written
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    src = token.to(tl.int64) * src_stride + offs
    dst = slot * ROW + offs
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] (contiguous: slot * Hkv * D is a
    # row)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(num_tokens, row), v.reshape(num_tokens, row)
    if k2.stride(1) != 1 or v2.stride(1) != 1 or k2.stride(0) != v2.stride(0):
        k2, v2 = k2.contiguous(), v2.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k2,
        v2,
        k_cache,
        v_cache,
        slot_mapping,
        k2.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )
