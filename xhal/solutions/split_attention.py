"""One attention group served by two backends: the paged decode solution for pure-decode steps,
the paged prefill solution for every other step (prefill, chunked prefill, mixed)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache
from xhal.interfaces.metadata import AttentionMetadata, BatchKind


class SplitAttention(AttentionBackend):
    """Both backends bind the same caches (the host's standard layout), so a step of either kind
    sees every token the other wrote. ``plan`` picks the backend by the step's kind and every
    layer's ``forward`` uses that one; graph buckets remember the backend they were planned on,
    so ``before_replay`` reaches the right one."""

    def __init__(
        self, spec: AttentionSpec, decode: AttentionBackend, prefill: AttentionBackend
    ) -> None:
        super().__init__(spec)
        self.decode, self.prefill = decode, prefill
        # the layer asks once, for every step: rotary in the KV write only if both sides fuse it
        self.fuses_rotary = decode.fuses_rotary and prefill.fuses_rotary
        self._current: AttentionBackend = prefill
        self._by_graph: dict[Hashable, AttentionBackend] = {}

    @property
    def reads_kv_cu_seq_lens(self) -> bool:
        return self.decode.reads_kv_cu_seq_lens or self.prefill.reads_kv_cu_seq_lens

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self.decode.bind_kv_caches(caches)
        self.prefill.bind_kv_caches(caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        self._current = self.decode if metadata.kind == BatchKind.DECODE else self.prefill
        if graph_key is not None:
            self._by_graph[graph_key] = self._current
        self._current.plan(metadata, graph_key)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self._current.forward(layer_id, q, k, v)

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        return self._current.forward_rotary(layer_id, q, k, v, positions, cos_sin_cache, is_neox)

    @property
    def fuses_qk_norm(self) -> bool:  # per step: the side this step was planned on
        return self._current.fuses_qk_norm

    def forward_qk_norm(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight,
                        k_weight, eps):  # fmt: skip
        return self._current.forward_qk_norm(
            layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight, k_weight, eps
        )

    @property
    def fuses_block(self) -> bool:  # per step: the side this step was planned on
        return self._current.fuses_block

    def forward_block(self, layer_id, block, hidden, residual, positions):
        return self._current.forward_block(layer_id, block, hidden, residual, positions)

    def before_replay(self, graph_key: Hashable) -> None:
        self._by_graph.get(graph_key, self._current).before_replay(graph_key)
