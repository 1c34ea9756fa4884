"""Rotary position embedding over a float32 cos/sin cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from xhal import ops
from xhal.layers.rope_scaling import compute_inv_freq, yarn_max_position


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` channels of each head of q and k by position.

    ``cos_sin_cache`` is float32 ``[max_position, rotary_dim]``: cos in the first half, sin in the
    second, already multiplied by the scaling type's attention factor (yarn). NeoX style pairs
    channel i with i + rotary_dim/2; GPT-J style pairs 2i with 2i + 1. ``rope_scaling`` is the
    checkpoint's scaling dict (``rope_type`` default, linear, llama3 or yarn, plus its fields).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        rope_scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_size={head_size}")
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        with torch.device("cpu"):  # whatever device the model is being built under
            inv_freq, attention_factor = compute_inv_freq(
                rope_scaling, base, rotary_dim, max_position
            )
        if (rope_scaling or {}).get("rope_type") == "yarn":
            max_position = yarn_max_position(rope_scaling, max_position)
        self.max_position = max_position
        # built on the CPU, as transformers does, then placed on the construction device
        freqs = torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None] * inv_freq
        cache = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        self.register_buffer(
            "cos_sin_cache", cache.to(torch.get_default_device()), persistent=False
        )  # [max_position, rotary_dim] float32

    def _apply(self, fn, recurse=True):
        """``module.to(dtype)`` moves the table but keeps it float32: rounded to bf16, cos / sin
        at large positions lose the precision rope needs (transformers keeps them float32 too)."""
        table = self.cos_sin_cache
        result = super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = table.to(device=self.cos_sin_cache.device)
        return result

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int ``[T]``; q ``[T, H*D]`` or ``[T, H, D]``, k likewise -> same shapes."""
        num_tokens, d = q.shape[0], self.head_size
        q3 = q if q.dim() == 3 else q.view(num_tokens, q.shape[-1] // d, d)  # [T, H, D]
        k3 = k if k.dim() == 3 else k.view(num_tokens, k.shape[-1] // d, d)  # [T, Hkv, D]
        q3, k3 = ops.rotary_embedding(positions, q3, k3, self.cos_sin_cache, self.is_neox_style)
        return q3.view(q.shape), k3.view(k.shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, neox={self.is_neox_style}"
        )
