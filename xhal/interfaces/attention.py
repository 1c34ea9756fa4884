"""The attention backend: paged KV write plus attention over the paged cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from xhal.interfaces.cache import LayerCache
from xhal.interfaces.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention group needs; layers with equal specs share a backend.

    ``sliding_window`` W (when set) lets a token at position p see keys at positions
    ``(p - W, p]``: W keys including itself, as in Hugging Face's Mistral.
    ``logits_soft_cap`` c (when set) maps each scaled score s to ``c * tanh(s / c)``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    scale: float | None = None  # defaults to head_dim ** -0.5
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"AttentionSpec needs positive head counts and head_dim, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class AttentionBlock:
    """A decoder layer's attention block as ``AttentionBackend.forward_block`` runs it: the input
    RMSNorm, the fused qkv projection (no bias), Qwen3's per-head q/k norms when given, the rotary
    embedding, and the o projection (no bias). Weights are this rank's: ``qkv_weight``
    ``[(H + 2 Hkv) * D, hidden]`` (q rows, then k, then v), ``o_weight`` ``[hidden, H * D]``."""

    norm_weight: torch.Tensor  # [hidden]
    norm_eps: float
    qkv_weight: torch.Tensor
    o_weight: torch.Tensor
    cos_sin_cache: torch.Tensor  # float32 [max_position, rotary_dim]: cos | sin
    is_neox: bool
    q_norm_weight: torch.Tensor | None = None  # [D], with k_norm_weight
    k_norm_weight: torch.Tensor | None = None
    qk_norm_eps: float = 0.0


class AttentionBackend(ABC):
    """Paged attention for one attention group (one ``AttentionSpec``).

    Lifecycle: ``bind_kv_caches`` once, then per step ``plan`` once and ``forward`` once per
    layer. Invariants:

    - ``plan`` does all host-side work of a step (reading ``*_host`` lengths, building index
      arrays); every layer's ``forward`` reuses that one plan. ``plan`` is never called inside a
      captured graph.
    - ``plan(metadata, graph_key=key)`` refreshes the static state a graph captured under ``key``
      reads; the executor calls it before capturing and before every replay of ``key``, with
      metadata of the bucket's padded shape whose device tensors are the bucket's persistent
      inputs: the same tensors at capture and at every replay, rewritten in place by the caller
      before ``plan`` (the host twins, ``*_host``, may be new tensors every step).
    - The graph-key policy, one for every backend: a captured bucket reads those persistent
      tensors in place (the graph's kernels read them when it replays; ``plan`` copies none of
      them into buffers of its own), and ``plan`` for a key refuses, with a ``ValueError``, device
      tensors other than those the key was captured with
      (``xhal.platforms.common.persistent.PersistentInputs``), since a replay would otherwise read
      stale addresses. In place is right on every device because the executor guarantees the
      persistence (``xhal/executor/decode_graph.py`` keeps one set of metadata tensors per
      bucket), so a per-step copy would only cost device work; what a backend derives from the
      metadata (FlashInfer's page indices, a dummy row's table) lives in its own buffers,
      refreshed in ``plan`` or inside the graph. One exception: the executor's decode graphs
      derive ``kv_cu_seq_lens`` inside the graph, before the first layer, so a backend reads
      that one from the graph only, never in ``plan`` (and only a backend that declares
      ``reads_kv_cu_seq_lens`` gets it derived at all). A bucket is captured on the executor's
      dummy step (every row kv_len 1, slot -1, ``max_seq_len`` the bucket's constant) and then
      replayed for real steps of any length up to the model's maximum, so nothing sized at
      capture may bound what a replay reads. The conformance graph family checks both halves.
    - Block-table entries past a row's ``ceil(kv_len / block_size)`` pages, and the rows of padding
      sequences, are unspecified: on the graph path they hold stale but valid block ids of
      earlier steps. Read only a row's own pages; never treat 0 as "end of row".
    - q, k and v may be strided views (the models pass slices of the fused qkv projection: row
      stride ``(H + 2 Hkv) * D``); the last dimension is contiguous. Honour ``stride()``, or copy.
    - ``paged_kv_*`` fields, when the host supplies them, describe the same pages as
      ``block_table`` and ``kv_seq_lens``; a backend may use them as given or ignore them, but
      never recompute them on the device path.
    - ``forward`` writes k and v at ``metadata.slot_mapping`` (rows with slot -1 are not written)
      and then attends over the cache, so a token sees its own K/V. It does no host sync and no
      allocation whose size depends on tensor values: it is safe to capture in a graph.
    - ``before_replay(graph_key)`` runs on the host right before a captured graph is replayed,
      after ``plan``. Backends whose graphs bake host arguments (NPU FIA's sequence lengths)
      update them here; the default does nothing.
    """

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache tensor for ``num_blocks`` blocks.

        Fixed by the host contract, not a backend choice: ``[num_blocks, block_size,
        num_kv_heads, head_dim]`` (xLLM's default ``KVCacheShape``). The host allocates the caches
        and shares them with its block manager, the executor allocates exactly this shape and
        ``bind_kv_caches`` receives it; the conformance suite checks that it is returned. Do not
        override it: a kernel that wants another layout views the standard one."""
        s = self.spec
        return (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    @abstractmethod
    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        """Bind the caches once; ``caches[layer_id]`` serves ``forward(layer_id, ...)``. Each is
        ``kv_cache_shape(num_blocks)`` in the spec's dtype; reject any other shape with a
        ``ValueError`` (``normalize_layer_caches`` checks the rank and key/value agreement)."""

    @abstractmethod
    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        """Host-side preparation for one step (or for graph bucket ``graph_key``)."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q ``[T, H, D]``, k and v ``[T, Hkv, D]`` -> out ``[T, H, D]`` in q's dtype."""

    #: Whether any ``forward*`` reads ``metadata.kv_cu_seq_lens`` on the device. The executor's
    #: decode graphs derive that field inside the graph (a prefix sum: two kernels a step on
    #: CUDA) only for backends that say so; for the others it holds unspecified values there. A
    #: backend that reads only ``kv_seq_lens`` (or its own plan) sets this False; the graph
    #: conformance family then replays it with the field left unwritten.
    reads_kv_cu_seq_lens: bool = True

    #: Whether ``forward_rotary`` is implemented. The layer calls it instead of rotating q and k
    #: itself only when this is true, so a backend that leaves it false keeps the plain contract.
    #: A backend may set it per instance (when the fused kernel depends on the device).
    fuses_rotary: bool = False

    def forward_rotary(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> torch.Tensor:
        """``forward(layer_id, q', k', v)`` with ``q', k' = rotary_embedding(positions, q, k,
        cos_sin_cache, is_neox)`` (``DeviceOps.rotary_embedding``'s definition), the rotation
        fused with the KV write: the cache receives k' and v at ``slot_mapping``. The same
        invariants as ``forward`` (graph-safe, strided inputs, slot -1 never written)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse rotary with the KV write")

    #: Whether ``forward_qk_norm`` serves the step planned last. Read by the layer after ``plan``
    #: at every forward (so inside a captured graph, once at capture), it may change from step to
    #: step: a backend whose decode kernel fuses the norm answers true for the steps that kernel
    #: takes and false for the others, where the layer then runs ``qk_rms_norm`` itself. Either
    #: way the norm happens exactly once.
    fuses_qk_norm: bool = False

    def forward_qk_norm(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``forward_rotary(layer_id, q', k', v, positions, cos_sin_cache, is_neox)`` with ``q',
        k'`` Qwen3's per-head RMSNorm of q and k (``DeviceOps.qk_rms_norm(q, k, q_weight,
        k_weight, eps)``: each head's D channels, q's with ``q_weight``, k's with ``k_weight``,
        rounded to the dtype), fused into the attention step: the cache receives the normed,
        rotated keys. The same invariants as ``forward`` (graph-safe, strided inputs, slot -1
        never written)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the q/k norm")

    #: Whether ``forward_block`` serves the step planned last; read like ``fuses_qk_norm`` (by the
    #: layer, after ``plan``, at every forward), and false for every step by default.
    fuses_block: bool = False

    def forward_block(
        self,
        layer_id: int,
        block: AttentionBlock,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decoder layer's whole attention block in one call, for a backend whose kernel runs
        it as one launch: ``(o, summed)`` where ``summed = hidden + residual`` (stored in the
        dtype), ``qkv = linear(rms_norm(summed, norm_weight), qkv_weight)`` (a kernel may skip
        rounding the normed rows, as ``DeviceOps.add_rms_norm_linear`` allows), q and k normed
        per head when the block has the weights (``forward_qk_norm``), then rotated, the KV
        write and attention as ``forward_rotary`` defines them, and ``o = linear(attn,
        o_weight)``: this rank's partial product, which the caller reduces over the ranks.
        ``hidden``, ``residual`` ``[T, hidden]``. The same invariants as ``forward``.

        None declines this call (operands the kernel does not read, or a shape first met under
        graph capture, where nothing can be built) before anything is computed or written: the
        layer then runs its own unfused sequence, so a backend never keeps a copy of it."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the attention block")

    def before_replay(self, graph_key: Hashable) -> None:
        """Replay hook: update host arguments a captured graph baked. Default: nothing to do."""
