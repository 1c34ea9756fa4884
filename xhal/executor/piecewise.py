"""Piecewise graphs for prefill and mixed batches: everything but attention is captured per
token-count bucket; attention runs eagerly between the pieces, with this step's plan."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from xhal.interfaces.metadata import AttentionMetadata, BatchKind

if TYPE_CHECKING:
    from xhal.executor.config import ExecutorConfig
    from xhal.interfaces.attention import AttentionBackend
    from xhal.interfaces.graph import GraphRunner
    from xhal.interfaces.platform import Platform


@dataclass
class _SplitAttention:
    """Stands in for a backend in the forward context while a piecewise graph is captured: each
    layer's attention becomes a split point of the capture."""

    backend: AttentionBackend
    graphs: GraphRunner

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.graphs.split(lambda: self.backend.forward(layer_id, q, k, v))

    @property
    def fuses_rotary(self) -> bool:
        return self.backend.fuses_rotary

    def forward_rotary(
        self, layer_id: int, q, k, v, positions, cos_sin_cache, is_neox
    ) -> torch.Tensor:
        return self.graphs.split(
            lambda: self.backend.forward_rotary(
                layer_id, q, k, v, positions, cos_sin_cache, is_neox
            )
        )

    @property
    def fuses_qk_norm(self) -> bool:
        return self.backend.fuses_qk_norm

    def forward_qk_norm(self, layer_id: int, q, k, v, positions, cos_sin_cache, is_neox,
                        q_weight, k_weight, eps) -> torch.Tensor:  # fmt: skip
        return self.graphs.split(
            lambda: self.backend.forward_qk_norm(
                layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight, k_weight, eps
            )
        )

    #: never: a piece captures the projections around attention, so the layer keeps them apart
    fuses_block = False


class PiecewiseGraphs:
    """A batch of T tokens runs in the smallest token bucket >= T: input ids and positions are
    copied into persistent buffers, the padding rows get slot -1, and the metadata's ``num_tokens``
    becomes the bucket. Backends are planned eagerly with that metadata every step (no graph key:
    attention is never inside a piece), so sequence lengths may change freely between replays."""

    def __init__(
        self,
        platform: Platform,
        backend_of: Mapping[int, AttentionBackend],
        backends: Sequence[AttentionBackend],
        config: ExecutorConfig,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, Mapping], torch.Tensor],
    ) -> None:
        self.backend_of, self.backends, self.forward = backend_of, backends, forward
        self.graphs = platform.graph_runner()
        self.sizes = config.token_capture_sizes
        n, device = self.sizes[-1], platform.device()
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int32, device=device)

    def bucket_for(self, metadata: AttentionMetadata) -> int | None:
        if metadata.kind not in (BatchKind.PREFILL, BatchKind.CHUNKED_PREFILL, BatchKind.MIXED):
            return None
        return next((s for s in self.sizes if s >= metadata.num_tokens), None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        bucket: int,
    ) -> torch.Tensor:
        t = metadata.num_tokens
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.input_ids[t:bucket].zero_()
        self.positions[:t].copy_(positions, non_blocking=True)
        self.positions[t:bucket].zero_()
        self.slot_mapping[:t].copy_(metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[t:bucket].fill_(-1)
        padded = replace(metadata, num_tokens=bucket, slot_mapping=self.slot_mapping[:bucket])
        for backend in self.backends:
            backend.plan(padded)
        key = ("tokens", bucket)
        if key not in self.graphs:
            split = {i: _SplitAttention(b, self.graphs) for i, b in self.backend_of.items()}
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            self.graphs.capture(key, lambda: self.forward(ids, pos, padded, split))
        return self.graphs.replay(key)[:t]

    def reset(self) -> None:
        self.graphs.reset()
