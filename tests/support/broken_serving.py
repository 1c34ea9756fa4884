"""Deliberately broken platforms whose bugs only show the way serving calls a backend.

Each is the CPU reference with one bug that an older suite passed and that corrupts served output:

- ``broken-kv-lens-in-plan`` (graph): plan derives kv lengths from ``kv_cu_seq_lens``, which a
  decode graph computes only inside the graph, so replays read the previous step's lengths.
- ``broken-kv-cu-undeclared`` (graph): attends over lengths taken from ``kv_cu_seq_lens`` while
  declaring ``reads_kv_cu_seq_lens`` false, so a decode graph, which then leaves that field
  unwritten, reads lengths no step staged.
- ``broken-zero-row-end`` (attention): the page count comes from the block table, taking the
  trailing zeros as its end; stale block ids past a row's pages are read as context.
- ``broken-strided-kv`` (attention): the KV write reads k and v as if contiguous, while the models
  pass slices of the fused qkv projection.
- ``broken-split-kv`` (attention): keys are processed in splits of 512 and the partial results
  merged without rescaling by the running maximum (exact below 512 keys).
- ``broken-row0-sampling`` (ops): row 0's temperature is used for every row.
- ``broken-group-broadcast`` (collective): ``broadcast(src)`` passes ``src`` to torch as a global
  rank where it is the group's rank.
- ``broken-rms-no-upcast`` (ops): RMSNorm computes in the input dtype (bfloat16) instead of
  float32.

Imported by ``tests.support.broken_platforms``, which registers these with the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch
import torch.distributed as dist

from xhal import platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.cpu_ref.attention import CpuAttention
from xhal.platforms.cpu_ref.collective import GlooCollective
from xhal.platforms.cpu_ref.kernels.paged_attention import attend, gather_sequence
from xhal.platforms.cpu_ref.ops import CpuOps
from xhal.platforms.cpu_ref.platform import CpuPlatform

SPLIT = 512  # keys per split of the split-KV kernel

_lib = torch.library.Library("xhal_broken_serving", "DEF")
_ATTENTION_SCHEMA = (
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_cu_seq_lens, Tensor kv_seq_lens, "
    "Tensor block_table, float scale, int sliding_window, float soft_cap) -> Tensor"
)
_lib.define("attention_pages_from_table" + _ATTENTION_SCHEMA)
_lib.define("attention_split_kv" + _ATTENTION_SCHEMA)
_lib.define(
    "write_kv_contiguous(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping) -> ()"
)


def _per_sequence(q, q_cu_seq_lens, kv_seq_lens, attend_one) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32)
    q_cu, kv_lens = q_cu_seq_lens.tolist(), kv_seq_lens.tolist()
    for i, kv_len in enumerate(kv_lens):
        start, end = q_cu[i], q_cu[i + 1]
        if end > start:
            out[start:end] = attend_one(i, q[start:end], kv_len)
    return out.to(q.dtype)


@torch.library.impl(_lib, "attention_pages_from_table", "CPU")
def attention_pages_from_table(q, k_cache, v_cache, q_cu, kv_lens, block_table, scale, window, cap):
    block_size = k_cache.shape[1]

    def one(i: int, q_rows: torch.Tensor, kv_len: int) -> torch.Tensor:
        # The author took vLLM's convention that block 0 is the null block padding a row: the
        # row's pages run to its last nonzero entry, and only the in-page offset of the last
        # token comes from kv_len. Right for rows padded with 0, wrong for a persistent table
        # whose columns past a row's pages hold stale ids.
        row = block_table[i].tolist()
        nonzero = [j for j, b in enumerate(row) if b != 0]
        pages = max(-(-kv_len // block_size), (nonzero[-1] + 1) if nonzero else 0)  # BUG
        length = (pages - 1) * block_size + (kv_len - 1) % block_size + 1
        keys = gather_sequence(k_cache, block_table[i], length)
        values = gather_sequence(v_cache, block_table[i], length)
        return attend(q_rows, keys, values, scale, window, cap)

    return _per_sequence(q, q_cu, kv_lens, one)


@torch.library.impl(_lib, "attention_split_kv", "CPU")
def attention_split_kv(q, k_cache, v_cache, q_cu, kv_lens, block_table, scale, window, cap):
    def one(i: int, q_rows: torch.Tensor, kv_len: int) -> torch.Tensor:
        q_len, num_heads = q_rows.shape[0], q_rows.shape[1]
        keys = gather_sequence(k_cache, block_table[i], kv_len).float()
        values = gather_sequence(v_cache, block_table[i], kv_len).float()
        group = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q_rows.float(), keys) * scale  # [H, Lq, L]
        if cap > 0:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        k_pos = torch.arange(kv_len).unsqueeze(0)
        visible = k_pos <= q_pos
        if window > 0:
            visible &= q_pos - k_pos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.zeros(num_heads, q_len, q_rows.shape[2])
        total = torch.zeros(num_heads, q_len, 1)
        for start in range(0, kv_len, SPLIT):
            part = scores[..., start : start + SPLIT]
            peak = part.amax(-1, keepdim=True)
            weights = torch.exp(part - torch.where(peak.isinf(), 0.0, peak))
            # BUG: each split is normalized by its own maximum and the splits are summed as they
            # are; the merge must first rescale each by exp(peak - overall maximum)
            out += torch.einsum("hqk,khd->hqd", weights, values[start : start + SPLIT])
            total += weights.sum(-1, keepdim=True)
        return (out / total).permute(1, 0, 2)

    return _per_sequence(q, q_cu, kv_lens, one)


for _name in ("attention_pages_from_table", "attention_split_kv"):

    @torch.library.register_fake(f"xhal_broken_serving::{_name}")
    def _(q, k_cache, v_cache, q_cu, kv_lens, block_table, scale, window, cap):
        return torch.empty_like(q)


@torch.library.impl(_lib, "write_kv_contiguous", "CPU")
def write_kv_contiguous(k, v, k_cache, v_cache, slot_mapping) -> None:
    # Ported from a kernel that indexes k and v as packed [T, Hkv, D] arrays: it takes their data
    # pointer and assumes the contiguous strides. Models pass slices of the fused qkv output,
    # whose rows are (H + 2 Hkv) * D apart, so it stores other tokens' (and q's) values.
    block_size = k_cache.shape[1]

    def packed(x: torch.Tensor) -> torch.Tensor:  # BUG: ignores x.stride()
        return x.as_strided(x.shape, torch.empty(x.shape).stride(), x.storage_offset())

    k, v = packed(k), packed(v)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def _reference_args(backend: CpuAttention, layer_id: int, q: torch.Tensor) -> tuple:
    cache, plan, spec = backend._caches[layer_id], backend._plan, backend.spec
    return (
        q, cache.key, cache.value, plan.q_cu_seq_lens, plan.kv_seq_lens, plan.block_table,
        spec.softmax_scale, spec.sliding_window or 0, spec.logits_soft_cap or 0.0,
    )  # fmt: skip


class _AttentionWithKernel(CpuAttention):
    """The reference backend with the attention kernel ``kernel`` (a torch op) swapped in."""

    kernel = None

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("forward called before plan(metadata)")
        cache = self._caches[layer_id]
        torch.ops.xhal_cpu_ref.write_kv(k, v, cache.key, cache.value, self._plan.slot_mapping)
        return type(self).kernel(*_reference_args(self, layer_id, q))


class _PagesFromTableAttention(_AttentionWithKernel):
    kernel = torch.ops.xhal_broken_serving.attention_pages_from_table


class _SplitKvAttention(_AttentionWithKernel):
    kernel = torch.ops.xhal_broken_serving.attention_split_kv


class _ContiguousWriteAttention(CpuAttention):
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("forward called before plan(metadata)")
        cache = self._caches[layer_id]
        torch.ops.xhal_broken_serving.write_kv_contiguous(
            k, v, cache.key, cache.value, self._plan.slot_mapping
        )
        return torch.ops.xhal_cpu_ref.paged_attention(*_reference_args(self, layer_id, q))


class _KvLensInPlanAttention(CpuAttention):
    reads_kv_cu_seq_lens = True  # it says so; the bug is reading it in plan

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        # BUG: the lengths are taken from kv_cu_seq_lens while planning. Eager steps carry them
        # fresh; a decode graph derives them inside the graph, after plan, so a replay reads the
        # previous step's.
        cu = metadata.kv_cu_seq_lens
        lens = (cu[1:] - cu[:-1]).to(torch.int32)
        super().plan(dataclasses.replace(metadata, kv_seq_lens=lens), graph_key)


class _KvCuUndeclaredAttention(CpuAttention):
    # BUG: attends over lengths taken from kv_cu_seq_lens when it runs (right in eager steps and
    # in graphs that derive the field) while keeping the reference's reads_kv_cu_seq_lens =
    # False, so a decode graph never writes the field for it
    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        super().plan(metadata, graph_key)
        self._cu = metadata.kv_cu_seq_lens

    def forward(self, layer_id, q, k, v):
        planned, cu = self._plan, self._cu
        self._plan = dataclasses.replace(planned, kv_seq_lens=(cu[1:] - cu[:-1]).to(torch.int32))
        try:
            return super().forward(layer_id, q, k, v)
        finally:
            self._plan = planned


class _Row0SamplingOps(CpuOps):
    def sample(self, logits, temperature, top_k, top_p, generator=None) -> torch.Tensor:
        # BUG: the kernel scales logits by one scalar temperature, the first row's (top-k and
        # top-p stay per row); right whenever a batch shares one temperature
        first = temperature[:1].expand(logits.shape[0]).contiguous()
        return super().sample(logits, first, top_k, top_p, generator=generator)


class _NoUpcastOps(CpuOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # BUG: the sum of squares and the scaling run in x's dtype, rounding at every step
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


class _GlobalRankBroadcast(GlooCollective):
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        out = x.clone()
        dist.broadcast(out, src=src, group=self.group)  # BUG: src is a group rank, not global
        return out


def _attention_platform(name: str, backend: type[CpuAttention]) -> type[CpuPlatform]:
    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        self.capabilities.attention.check(spec)
        return backend(spec)

    return type(name, (CpuPlatform,), {"name": name, "attention_backend": attention_backend})


def _ops_platform(name: str, ops: type[CpuOps]) -> type[CpuPlatform]:
    def __init__(self) -> None:
        self._ops = ops()

    return type(name, (CpuPlatform,), {"name": name, "__init__": __init__})


class BrokenGroupBroadcastPlatform(CpuPlatform):
    name = "broken-group-broadcast"

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        base = super().collective(group)
        return _GlobalRankBroadcast(base.group) if isinstance(base, GlooCollective) else base


SERVING_BUGS = (
    _attention_platform("broken-kv-lens-in-plan", _KvLensInPlanAttention),
    _attention_platform("broken-kv-cu-undeclared", _KvCuUndeclaredAttention),
    _attention_platform("broken-zero-row-end", _PagesFromTableAttention),
    _attention_platform("broken-strided-kv", _ContiguousWriteAttention),
    _attention_platform("broken-split-kv", _SplitKvAttention),
    _ops_platform("broken-row0-sampling", _Row0SamplingOps),
    _ops_platform("broken-rms-no-upcast", _NoUpcastOps),
    BrokenGroupBroadcastPlatform,
)
for _cls in SERVING_BUGS:
    platforms.register(_cls.name, _cls)
