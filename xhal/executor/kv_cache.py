"""Sizing and allocating paged KV caches for hosts that do not bring their own."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.cache import LayerCache


def bytes_per_block(specs: Mapping[int, AttentionSpec]) -> int:
    """Bytes one block costs across all layers (K and V)."""
    total = 0
    for spec in specs.values():
        elem = torch.empty((), dtype=spec.dtype).element_size()
        total += 2 * spec.block_size * spec.num_kv_heads * spec.head_dim * elem
    return total


def num_blocks_for_budget(specs: Mapping[int, AttentionSpec], budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``; raises when not even one does."""
    per_block = bytes_per_block(specs)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block ({per_block} bytes per block "
            "across all layers): raise the budget or lower the block size"
        )
    return int(num_blocks)


def allocate_kv_caches(
    specs: Mapping[int, AttentionSpec], num_blocks: int, device: torch.device
) -> list[LayerCache]:
    """Zeroed caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, one per layer id."""
    if sorted(specs) != list(range(len(specs))):
        raise ValueError(f"layer ids must be 0..{len(specs) - 1}, got {sorted(specs)}")
    caches = []
    for layer_id in range(len(specs)):
        s = specs[layer_id]
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        caches.append(
            LayerCache(
                torch.zeros(shape, dtype=s.dtype, device=device),
                torch.zeros(shape, dtype=s.dtype, device=device),
            )
        )
    return caches
