"""Reference attention backend: per-sequence dense attention over K/V gathered from the cache."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from xhal.cpu_ref.kernels import paged  # noqa: F401  (registers torch.ops.xhal_cpu_ref)
from xhal.interfaces.attention import AttentionBackend
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata


@dataclass
class _Plan:
    q_cu_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    def refill(self, metadata: AttentionMetadata) -> None:
        for name in ("q_cu_seq_lens", "kv_seq_lens", "block_table", "slot_mapping"):
            static, live = getattr(self, name), getattr(metadata, name)
            if static.shape != live.shape:
                raise ValueError(
                    f"graph bucket was planned with {name} of shape {tuple(static.shape)}, now "
                    f"{tuple(live.shape)}: pad metadata to the bucket's shape before planning it"
                )
            static.copy_(live)


class CpuAttention(AttentionBackend):
    def __init__(self, spec) -> None:
        super().__init__(spec)
        self._caches: list[LayerCache] = []
        self._plan: _Plan | None = None
        self._graph_plans: dict[Hashable, _Plan] = {}

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        live = _Plan(
            metadata.q_cu_seq_lens, metadata.kv_seq_lens, metadata.block_table, metadata.slot_mapping
        )
        if graph_key is None:
            self._plan = live
            return
        # a captured bucket reads static buffers of its own, refreshed before every replay
        if graph_key not in self._graph_plans:
            self._graph_plans[graph_key] = _Plan(*(t.clone() for t in vars(live).values()))
        else:
            self._graph_plans[graph_key].refill(metadata)
        self._plan = self._graph_plans[graph_key]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("CpuAttention.forward called before plan(metadata)")
        cache, plan, spec = self._caches[layer_id], self._plan, self.spec
        torch.ops.xhal_cpu_ref.write_kv(k, v, cache.key, cache.value, plan.slot_mapping)
        return torch.ops.xhal_cpu_ref.paged_attention(
            q,
            cache.key,
            cache.value,
            plan.q_cu_seq_lens,
            plan.kv_seq_lens,
            plan.block_table,
            spec.softmax_scale,
            spec.sliding_window or 0,
            spec.logits_soft_cap or 0.0,
        )
