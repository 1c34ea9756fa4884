"""A layer's paged KV cache, and the normalization of xLLM's per-layer tuples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LayerCache:
    """One layer's paged KV cache.

    ``key`` and ``value`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (xLLM's default
    ``KVCacheShape``); token slot ``s`` lives at ``[s // block_size, s % block_size]``. The
    optional fields mirror xLLM's tuple ``(k, v, index, conv, ssm, index_scale)``; the attention
    backends in xhal use only ``key`` and ``value``.
    """

    key: torch.Tensor
    value: torch.Tensor
    index: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None
    index_scale: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.key.shape[0]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]


def normalize_layer_caches(caches: Sequence[Any]) -> list[LayerCache]:
    """Accept ``LayerCache`` objects, ``(k, v)`` pairs or xLLM's 6-tuples with ``None`` slots."""
    out: list[LayerCache] = []
    for i, c in enumerate(caches):
        if isinstance(c, LayerCache):
            out.append(c)
            continue
        if not isinstance(c, (tuple, list)) or len(c) < 2 or len(c) > 6:
            raise ValueError(
                f"KV cache of layer {i} is a {type(c).__name__}; expected LayerCache, (k, v) or "
                "xLLM's (k, v, index, conv, ssm, index_scale) tuple"
            )
        if c[0] is None or c[1] is None:
            raise ValueError(f"KV cache of layer {i} has no key or value tensor")
        out.append(LayerCache(*c))
    for i, c in enumerate(out):
        if c.key.dim() != 4 or c.key.shape != c.value.shape:
            raise ValueError(
                f"KV cache of layer {i}: key {tuple(c.key.shape)} and value {tuple(c.value.shape)} "
                "must both be [num_blocks, block_size, num_kv_heads, head_dim]"
            )
    return out
