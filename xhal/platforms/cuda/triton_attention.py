"""CUDA attention without FlashInfer: one Triton kernel for every batch kind (``cuda-triton``, and
``cuda`` where FlashInfer is not installed)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xhal import env
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.common.persistent import PersistentInputs
from xhal.platforms.cuda.kernels.kv_write import write_kv
from xhal.platforms.cuda.kernels.paged_attention import paged_attention
from xhal.platforms.cuda.kernels.rotary_kv import rotary_write_kv


@dataclass
class _TritonPlan:
    token_seq: torch.Tensor
    q_cu_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    q_lens_host: np.ndarray | None = None  # a graph plan's query lengths, which fix token_seq
    captured: PersistentInputs | None = None  # a graph plan's metadata tensors


class TritonAttention(AttentionBackend):
    """The fallback: one Triton kernel for every batch kind, any float dtype.

    A graph bucket's plan reads the persistent metadata in place (the ``AttentionBackend``
    graph-key policy) and rebuilds its one own input, each token's sequence, only when the
    query lengths change: a decode replay's plan queues no device work."""

    reads_kv_cu_seq_lens = False

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.fuses_rotary = env.cuda_fused()  # rotary_kv.py: rotary in the KV write's launch
        self._caches: list[LayerCache] = []
        self._plan: _TritonPlan | None = None
        self._graph_plans: dict[Hashable, _TritonPlan] = {}

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    @staticmethod
    def _token_seq(m: AttentionMetadata) -> torch.Tensor:
        """Each query row's sequence (-1 for padding rows), on the device."""
        seq_ids = torch.repeat_interleave(
            torch.arange(m.num_seqs, dtype=torch.int32), m.q_seq_lens_host
        )
        pad = torch.full((m.num_tokens - seq_ids.shape[0],), -1, dtype=torch.int32)
        return torch.cat([seq_ids, pad]).to(m.device, non_blocking=True)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        m = metadata
        tables = (m.q_cu_seq_lens, m.kv_seq_lens, m.block_table, m.slot_mapping)
        if graph_key is None:
            self._plan = _TritonPlan(self._token_seq(m), *tables)
            return
        plan, q_lens = self._graph_plans.get(graph_key), m.q_seq_lens_host.numpy()
        if plan is None:
            captured = PersistentInputs(graph_key, *tables)
            plan = _TritonPlan(self._token_seq(m), *tables, q_lens.copy(), captured)
            self._graph_plans[graph_key] = plan
        else:
            plan.captured.check(*tables)
        if not np.array_equal(q_lens, plan.q_lens_host):
            plan.token_seq.copy_(self._token_seq(m), non_blocking=True)
            plan.q_lens_host = q_lens.copy()
        self._plan = plan

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cache = self._caches[layer_id]
        write_kv(k, v, cache.key, cache.value, self._plan.slot_mapping)
        return self._attend(q, cache)

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        cache = self._caches[layer_id]
        q = rotary_write_kv(
            positions,
            q,
            k,
            v,
            cos_sin_cache,
            is_neox,
            cache.key,
            cache.value,
            self._plan.slot_mapping,
        )
        return self._attend(q, cache)

    def _attend(self, q: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        p, s = self._plan, self.spec
        out = torch.zeros_like(q)
        return paged_attention(
            q,
            cache.key,
            cache.value,
            p.token_seq,
            p.q_cu_seq_lens,
            p.kv_seq_lens,
            p.block_table,
            s.softmax_scale,
            s.logits_soft_cap or 0.0,
            s.sliding_window or 0,
            out,
        )
