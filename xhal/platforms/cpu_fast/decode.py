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
    """q ``[B, H, D]``; k, v ``[B * Hkv, L, D]``, sequence-major (views of the cache or one
    gather, any strides with unit channel stride); ``bias`` float32 ``[B * Hkv, 1, L]`` added to
    the scores (0 where visible, -inf where not) or None -> ``[B, H, D]`` float32. Query heads
    ``h`` of KV head ``h // (H / Hkv)`` are consecutive, so each group is one ``[G, D]`` matrix
    of q."""
    batch, heads, dim = q.shape
    groups = k.shape[0]  # B * Hkv
    q = q.reshape(groups, heads * batch // groups, dim)  # [B Hkv, G, D]
    # bmm then an in-place scale: baddbmm's alpha costs more than the product here
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)  # [B Hkv, G, L]
    if bias is not None:
        scores += bias
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(batch, heads, dim)
