"""Triton paged attention: the fallback when FlashInfer is absent.

One program per (query token, KV head) computes the attention of that token's query heads sharing
the KV head (GQA) over its sequence's visible keys, read block by block through the block table,
with an online softmax. Correct for every batch kind; built for portability, not peak speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    token_seq_ptr, q_cu_ptr, kv_lens_ptr, block_table_ptr,
    scale, soft_cap, window,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride,
    cache_stride_block, cache_stride_pos, cache_stride_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(token_seq_ptr + token)
    if seq < 0:  # padding row
        return
    q_start = tl.load(q_cu_ptr + seq)
    q_len = tl.load(q_cu_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    pos = kv_len - q_len + (token - q_start)  # bottom-right aligned causal position

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741  (m, l: the online-softmax max and sum)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    lo = 0
    if window > 0:
        lo = tl.maximum(pos - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        visible = n <= pos
        if window > 0:
            visible = visible & (pos - n < window)
        block = tl.load(
            block_table_ptr + seq * bt_stride + n // BLOCK_SIZE, mask=visible, other=0
        ).to(tl.int64)
        offs = (
            block * cache_stride_block
            + (n % BLOCK_SIZE) * cache_stride_pos
            + kv_head * cache_stride_head
        )
        kv_mask = visible[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        if soft_cap > 0:
            s = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * s / soft_cap)) - 1.0)  # tanh via exp
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741  (the online-softmax sum)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(
        out_ptr + token * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_seq: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    soft_cap: float,
    window: int,
    out: torch.Tensor,
) -> torch.Tensor:
    # q, out: [T, H, D]; token_seq: int32 [T], the sequence of each row (-1 for padding rows)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    group_pad = max(triton.next_power_of_2(group), 1)
    block_n = max(16, min(64, 8192 // (group_pad * dim_pad)))
    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        token_seq,
        q_cu_seq_lens,
        kv_seq_lens,
        block_table,
        scale,
        soft_cap,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
    )
    return out
