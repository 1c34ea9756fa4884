"""Reference paged attention, as a custom op so that a captured "graph" records it as one device
call: like a device kernel, it reads its length and index tensors when it runs, not when it was
captured. The KV write that precedes it is ``kv_write.py``."""

from __future__ import annotations

import torch

# a fragment: kv_write.py adds its op to the same namespace
_lib = torch.library.Library("xhal_cpu_ref", "FRAGMENT")
_lib.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_cu_seq_lens, "
    "Tensor kv_seq_lens, Tensor block_table, float scale, int sliding_window, float soft_cap) -> "
    "Tensor"
)


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` tokens of one sequence, ``[kv_len, Hkv, D]``, read by its block row."""
    block_size = cache.shape[1]
    positions = torch.arange(kv_len)
    return cache[block_row[positions // block_size].long(), positions % block_size]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """float32 attention of ``q`` ``[Lq, H, D]``, the sequence's last ``Lq`` positions, over its
    ``keys`` / ``values`` ``[L, Hkv, D]``: causal (bottom-right aligned), the last
    ``sliding_window`` positions only when it is > 0, logits capped by ``soft_cap`` when > 0."""
    q_len, kv_len, num_heads = q.shape[0], keys.shape[0], q.shape[1]
    group = num_heads // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # [L, H, D]
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # [H, Lq, L]
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
    k_pos = torch.arange(kv_len).unsqueeze(0)
    visible = k_pos <= q_pos
    if sliding_window > 0:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)


@torch.library.impl(_lib, "paged_attention", "CPU")
def paged_attention(
    q, k_cache, v_cache, q_cu_seq_lens, kv_seq_lens, block_table, scale, sliding_window, soft_cap
):
    # q: [T, H, D]; rows past q_cu_seq_lens[-1] are padding and come out as zeros
    out = torch.zeros(q.shape, dtype=torch.float32)
    q_cu, kv_lens = q_cu_seq_lens.tolist(), kv_seq_lens.tolist()
    for i, kv_len in enumerate(kv_lens):
        start, end = q_cu[i], q_cu[i + 1]
        if end == start:
            continue
        keys = gather_sequence(k_cache, block_table[i], kv_len)  # [L, Hkv, D]
        values = gather_sequence(v_cache, block_table[i], kv_len)
        out[start:end] = attend(q[start:end], keys, values, scale, sliding_window, soft_cap)
    return out.to(q.dtype)


@torch.library.register_fake("xhal_cpu_ref::paged_attention")
def _(
    q, k_cache, v_cache, q_cu_seq_lens, kv_seq_lens, block_table, scale, sliding_window, soft_cap
):
    return torch.empty_like(q)
