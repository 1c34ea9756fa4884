"""The skeleton of a CUDA backend whose decode steps run a kernel of its own and whose other
steps run the backend it wraps: ``SplitKVDecodeAttention`` (``splitkv_attention.py``) and
``TileLangAttention`` (``tilelang_attention.py``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata, BatchKind
from xhal.platforms.common.persistent import PersistentInputs


@dataclass
class DecodePlan:
    """A decode step's plan, what every layer's launch reads: the metadata's device tensors, kept
    by reference (for a graph bucket, its persistent inputs), and the step's split count. A
    backend adds what its own kernel needs."""

    num_seqs: int
    block_table: torch.Tensor  # int32 [B, max_blocks]
    kv_seq_lens: torch.Tensor  # int32 [B]
    slot_mapping: torch.Tensor  # int32 [T]
    splits: int


class DecodeOverFallback(AttentionBackend):
    """Decode steps on the subclass's kernel, every other step on ``fallback`` (a backend of the
    same spec).

    A subclass says which steps it takes (``takes``), what its decode plan holds
    (``plan_decode``) and how a layer attends with it (``decode``, and ``decode_rotary`` when it
    sets ``fuses_rotary``). Shared here: the routing (a step not taken is planned and run by the
    fallback, whose graph buckets then stay its own), the caches bound on both, and for a decode
    bucket the graph-key policy: its metadata tensors recorded at its first plan and refused if
    another plan of that key brings others, since the captured launch reads them in place."""

    def __init__(self, spec: AttentionSpec, fallback: AttentionBackend) -> None:
        super().__init__(spec)
        self.fallback = fallback
        self._caches: list[LayerCache] = []
        self._captured: dict[Hashable, PersistentInputs] = {}  # decode graph key -> its tensors
        self._decode: DecodePlan | None = None  # the step's decode plan; None: the fallback's step
        # graph key -> (the metadata of its last plan, that plan or None: the fallback's bucket)
        self._last: dict[Hashable, tuple[AttentionMetadata, DecodePlan | None]] = {}

    def takes(self, m: AttentionMetadata) -> bool:
        """Whether a step runs on the decode kernel: a pure decode, one query row per sequence."""
        return m.kind == BatchKind.DECODE and m.max_query_len <= 1 and m.num_seqs > 0

    def plan_decode(self, m: AttentionMetadata, graph_key: Hashable | None) -> DecodePlan:
        """The decode plan of a step ``takes`` accepted (host work only)."""
        raise NotImplementedError

    def decode(
        self, plan: DecodePlan, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``forward`` of a decode step, with its plan."""
        raise NotImplementedError

    def decode_rotary(self, plan: DecodePlan, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        """``forward_rotary`` of a decode step, with its plan (when ``fuses_rotary``)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse rotary into its decode")

    @property
    def reads_kv_cu_seq_lens(self) -> bool:  # the decode kernels read kv_seq_lens only
        return self.fallback.reads_kv_cu_seq_lens

    #: Whether ``decode_qk_norm`` is implemented: ``fuses_qk_norm`` for the decode steps taken.
    decode_fuses_qk_norm: bool = False

    def decode_qk_norm(self, plan: DecodePlan, layer_id, q, k, v, positions, cos_sin_cache,
                       is_neox, q_weight, k_weight, eps):  # fmt: skip
        """``forward_qk_norm`` of a decode step, with its plan (when ``decode_fuses_qk_norm``)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the q/k norm")

    @property
    def fuses_qk_norm(self) -> bool:
        """Per step: the decode kernel's answer for a step it takes, the fallback's otherwise."""
        if self._decode is None:
            return self.fallback.fuses_qk_norm
        return self.decode_fuses_qk_norm

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)
        self.fallback.bind_kv_caches(self._caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        m = metadata
        if graph_key is not None:
            # a bucket planned with the very metadata object of its last plan (the executor's
            # persistent one, every step): the same routing, tensors and plan (a decode plan is
            # host work on the metadata's host fields alone), so nothing to redo here
            last = self._last.get(graph_key)
            if last is not None and last[0] is m:
                self._decode = last[1]
                if last[1] is None:
                    self.fallback.plan(m, graph_key)
                return
        if not self.takes(m):
            self._decode = None
            self.fallback.plan(m, graph_key)
        else:
            if graph_key is not None:
                tables = (m.block_table, m.kv_seq_lens, m.slot_mapping)
                captured = self._captured.get(graph_key)
                if captured is None:
                    self._captured[graph_key] = PersistentInputs(graph_key, *tables)
                else:
                    captured.check(*tables)
            self._decode = self.plan_decode(m, graph_key)
        if graph_key is not None:
            self._last[graph_key] = m, self._decode

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._decode is None:
            return self.fallback.forward(layer_id, q, k, v)
        return self.decode(self._decode, layer_id, q, k, v)

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        if self._decode is None:
            return self.fallback.forward_rotary(
                layer_id, q, k, v, positions, cos_sin_cache, is_neox
            )
        return self.decode_rotary(
            self._decode, layer_id, q, k, v, positions, cos_sin_cache, is_neox
        )

    def forward_qk_norm(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight,
                        k_weight, eps):  # fmt: skip
        args = (layer_id, q, k, v, positions, cos_sin_cache, is_neox, q_weight, k_weight, eps)
        if self._decode is None:
            return self.fallback.forward_qk_norm(*args)
        return self.decode_qk_norm(self._decode, *args)

    def before_replay(self, graph_key: Hashable) -> None:
        if graph_key not in self._captured:  # a bucket of the fallback's
            self.fallback.before_replay(graph_key)

    @staticmethod
    def padded_output(q: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """The output of a decode step: one row per sequence first, written by the kernel, then
        the bucket's padding rows, zeroed (nothing else writes them)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] > num_seqs:
            out[num_seqs:].zero_()
        return out

    @staticmethod
    def unit_stride(t: torch.Tensor) -> torch.Tensor:
        """``t`` with a contiguous last dimension: copied on the device when it is not, so a
        captured graph copies the replay's values."""
        return t if t.stride(-1) == 1 else t.contiguous()
