"""The model-side attention layer: shapes in, backend call through the step's context."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from xhal import ops
from xhal.interfaces.attention import AttentionBlock, AttentionSpec
from xhal.interfaces.forward_context import get_forward_context

if TYPE_CHECKING:
    from xhal.layers.norm import RMSNorm
    from xhal.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Paged attention for one decoder layer, served by the step's backend for ``layer_id``.

    Head counts are this rank's. The layer holds no cache, plan or state: the backend (already
    planned for the step) and the caches bound to it are reached through ``get_forward_context()``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        layer_id: int = 0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads or num_heads
        self.head_dim, self.scale, self.layer_id = head_dim, scale, layer_id
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap

    def spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        """The ``AttentionSpec`` a backend serving this layer must be created with."""
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            block_size=block_size,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """q ``[T, H*D]`` or ``[T, H, D]``, k and v likewise with Hkv -> out ``[T, H*D]``. With
        ``rotary`` (and the step's ``positions``), q and k are rotated first: by the backend in
        its KV write when it declares ``fuses_rotary``, by ``rotary`` otherwise. With ``q_norm``
        and ``k_norm`` (Qwen3: RMSNorm over each head's D channels, before rotary), q and k are
        normed before that: by the backend when it says ``fuses_qk_norm`` for this step (with
        rotary), by ``ops.qk_rms_norm`` here otherwise."""
        num_tokens = q.shape[0]
        backend = self._backend()
        if (q_norm is None) != (k_norm is None):
            raise ValueError("Attention takes q_norm and k_norm together (Qwen3's per-head norms)")
        if q_norm is not None:
            if rotary is not None and backend.fuses_qk_norm:
                out = backend.forward_qk_norm(
                    self.layer_id, self._heads(q, self.num_heads), self._heads(k),
                    self._heads(v), positions, rotary.cos_sin_cache, rotary.is_neox_style,
                    q_norm.weight, k_norm.weight, q_norm.eps,
                )  # fmt: skip
                return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]
            q, k = ops.qk_rms_norm(
                q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), q_norm.weight,
                k_norm.weight, q_norm.eps,
            )  # fmt: skip
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if rotary is None:
            out = backend.forward(self.layer_id, q, k, v)  # [T, H, D]
        elif backend.fuses_rotary:
            out = backend.forward_rotary(
                self.layer_id, q, k, v, positions, rotary.cos_sin_cache, rotary.is_neox_style
            )
        else:
            q, k = rotary(positions, q, k)
            out = backend.forward(self.layer_id, q, k, v)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H*D]

    def fuses_block(self) -> bool:
        """Whether the step's backend runs this layer's whole attention block in one call
        (``AttentionBackend.fuses_block``; read after the step's plan, like ``fuses_qk_norm``)."""
        return self._backend().fuses_block

    def forward_block(
        self,
        block: AttentionBlock,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(o, hidden + residual)`` by the backend's ``forward_block``, when ``fuses_block``:
        ``o`` is this rank's partial o projection ``[T, hidden]``, which the caller reduces.
        None when the backend declines this call: the caller runs the unfused sequence."""
        return self._backend().forward_block(self.layer_id, block, hidden, residual, positions)

    def _backend(self):
        backends = get_forward_context().attention
        if self.layer_id not in backends:
            raise RuntimeError(
                f"the forward context has no attention backend for layer {self.layer_id} "
                f"(it serves layers {sorted(backends)})"
            )
        return backends[self.layer_id]

    def _heads(self, x: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """``[T, heads*D]`` (or already ``[T, heads, D]``) -> ``[T, heads, D]``, a view."""
        return x.view(x.shape[0], num_heads or self.num_kv_heads, self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, sliding_window={self.sliding_window}"
        )


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's ``Attention`` layers ordered by ``layer_id``, checked to be exactly 0..L-1."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_id
    )
    ids = [m.layer_id for m in layers]
    if ids != list(range(len(layers))):
        raise ValueError(f"Attention layer_ids must be 0..{len(layers) - 1} once each, got {ids}")
    return layers
