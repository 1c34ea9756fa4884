"""Reference attention backend: per-sequence dense attention over K/V gathered from the cache."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from xhal.interfaces.attention import AttentionBackend
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.common.persistent import PersistentInputs
from xhal.platforms.cpu_ref.kernels import kv_write, paged_attention  # noqa: F401  (register torch.ops.xhal_cpu_ref)


@dataclass
class _Plan:
    q_cu_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class CpuAttention(AttentionBackend):
    reads_kv_cu_seq_lens = False

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self._caches: list[LayerCache] = []
        self._plan: _Plan | None = None
        self._captured: dict[Hashable, PersistentInputs] = {}

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        live = _Plan(
            metadata.q_cu_seq_lens,
            metadata.kv_seq_lens,
            metadata.block_table,
            metadata.slot_mapping,
        )
        if graph_key is not None:
            # a captured bucket reads the executor's persistent tensors in place: its kernels
            # read them when the "graph" replays, so they must be the ones it was captured with
            tensors = tuple(vars(live).values())
            captured = self._captured.setdefault(graph_key, PersistentInputs(graph_key, *tensors))
            captured.check(*tensors)
        self._plan = live

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
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
