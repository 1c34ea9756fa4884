"""CPU backends that run a decoder layer's whole attention block in one call
(``AttentionBackend.forward_block``), for the tests of that contract on a machine with no GPU:

- ``SequenceBlockPlatform``: the reference, saying ``fuses_block`` for decode steps and running
  the block as the plain sequence of reference ops (what a fused kernel must reproduce).
- ``StaleKeyBlockPlatform``: the same with the bug a fused kernel's author writes when the KV
  write happens before the rotation: the cache receives the unrotated keys (attention itself
  uses the rotated ones, so only the next step's reads would show it).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from xhal import ops
from xhal.interfaces import AttentionBlock, AttentionSpec, BatchKind
from xhal.platforms.cpu_ref.attention import CpuAttention
from xhal.platforms.cpu_ref.platform import CpuPlatform


class SequenceBlockAttention(CpuAttention):
    """Says ``fuses_block`` for decode steps; the block as the reference's plain sequence."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.block_calls = 0

    def plan(self, metadata, graph_key: Hashable | None = None) -> None:
        super().plan(metadata, graph_key)
        self.fuses_block = metadata.kind == BatchKind.DECODE

    def forward_block(
        self,
        layer_id: int,
        block: AttentionBlock,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.block_calls += 1
        s = self.spec
        h, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        qkv, summed = ops.add_rms_norm_linear(
            hidden, residual, block.norm_weight, block.norm_eps, block.qkv_weight
        )
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        if block.q_norm_weight is not None:
            q, k = ops.qk_rms_norm(
                q, k, block.q_norm_weight, block.k_norm_weight, block.qk_norm_eps
            )
        q = q.reshape(num_tokens, h, d)  # [T, H, D]
        k = k.reshape(num_tokens, hkv, d)  # [T, Hkv, D]
        v = v.reshape(num_tokens, hkv, d)
        out = self.attend(layer_id, q, k, v, positions, block)
        return ops.linear(out.reshape(num_tokens, h * d), block.o_weight), summed

    def attend(self, layer_id, q, k, v, positions, block) -> torch.Tensor:
        q, k = ops.rotary_embedding(positions, q, k, block.cos_sin_cache, block.is_neox)
        return self.forward(layer_id, q, k, v)


class _StaleKeyBlockAttention(SequenceBlockAttention):
    def attend(self, layer_id, q, k, v, positions, block) -> torch.Tensor:
        # BUG: the KV write before the rotation: the cache holds the unrotated keys, while this
        # step's own attention uses the rotated ones
        self.forward(layer_id, q, k, v)
        q_rot, k_rot = ops.rotary_embedding(positions, q, k, block.cos_sin_cache, block.is_neox)
        return self._attend_without_write(layer_id, q_rot, k_rot, v)

    def _attend_without_write(self, layer_id, q, k, v) -> torch.Tensor:
        cache = self._caches[layer_id]
        saved = cache.key.clone(), cache.value.clone()
        out = self.forward(layer_id, q, k, v)  # writes the rotated keys...
        cache.key.copy_(saved[0])  # ...which the bug never wrote
        cache.value.copy_(saved[1])
        return out


class _BlockPlatform(CpuPlatform):
    """The reference platform whose attention is ``backend_class``."""

    backend_class: type[CpuAttention]

    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        self.capabilities.attention.check(spec)
        return self.backend_class(spec)


class SequenceBlockPlatform(_BlockPlatform):
    name = "cpu-block-sequence"
    backend_class = SequenceBlockAttention


class StaleKeyBlockPlatform(_BlockPlatform):
    name = "cpu-block-stale-key"
    backend_class = _StaleKeyBlockAttention


class _DecliningBlockAttention(SequenceBlockAttention):
    """Says ``fuses_block`` for decode steps, then declines every call (counted)."""

    def forward_block(self, layer_id, block, hidden, residual, positions):
        self.block_calls += 1
        return None


class DecliningBlockPlatform(_BlockPlatform):
    name = "cpu-block-declining"
    backend_class = _DecliningBlockAttention
