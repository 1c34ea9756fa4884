"""Attention of one-token sequences (decodes) over their keys in three batched matrix calls:
every query head of a KV head's group against that head's keys at once. For float32 caches;
cheaper than SDPA at these sizes, whose CPU kernel sets up query blocks and threads for long
queries (a decode has one row per head)."""

from __future__ import annotations

import torch


def one_token_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """q ``[B, H, D]``; k, v ``[B, L, Hkv, D]`` (views of the cache, any strides); ``bias``
    float32 ``[B * Hkv, 1, L]`` added to the scores (0 where visible, -inf where not) or None
    -> ``[B, H, D]`` float32. Query heads ``h`` of KV head ``h // (H / Hkv)`` are consecutive, so
    each group is one ``[G, D]`` matrix of q."""
    batch, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    q = q.reshape(batch * kv_heads, heads // kv_heads, dim)  # [B Hkv, G, D]
    kt = k.permute(0, 2, 3, 1).reshape(batch * kv_heads, dim, length)  # a view when B == 1
    v = v.transpose(1, 2).reshape(batch * kv_heads, length, dim)  # [B Hkv, L, D]
    # bmm then an in-place scale: baddbmm's alpha costs more than the product here
    scores = torch.bmm(q, kt).mul_(scale)  # [B Hkv, G, L]
    if bias is not None:
        scores += bias
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(batch, heads, dim)
