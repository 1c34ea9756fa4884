"""A complete xhal platform written from scratch in plain torch: the skeleton of a new backend.

Nothing here comes from ``xhal.platforms.cpu_ref``; every piece is written against
``xhal.interfaces`` alone, as a backend for new hardware would be, with the device kernels replaced
by torch calls. Register it as a plugin and run the suite on it::

    xhal-conformance --device skeleton --plugin examples.skeleton.skeleton_backend

It declares what it really does: float32 attention and ops, any head dim (tested on 32 and 64),
block size 16, no sliding window or soft cap, no graphs (a graph runner is the next step: see
docs/writing-a-backend.md), collectives over gloo.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from xhal import platforms
from xhal.interfaces import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionMetadata,
    AttentionSpec,
    Capabilities,
    Collective,
    DeviceOps,
    GraphRunner,
    LayerCache,
    Platform,
    normalize_layer_caches,
)


class SkeletonAttention(AttentionBackend):
    """Per-sequence dense attention over K/V gathered by block table; host lengths from plan."""

    # it reads the host twins of the lengths, never kv_cu_seq_lens: decode graphs need not
    # derive that field for it
    reads_kv_cu_seq_lens = False

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.caches: list[LayerCache] = []
        self.metadata: AttentionMetadata | None = None
        self.seqs: list[tuple[int, int, int]] = []  # (first row, q_len, kv_len) per sequence

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self.caches = normalize_layer_caches(caches)
        for i, cache in enumerate(self.caches):
            expected = self.kv_cache_shape(cache.num_blocks)
            if tuple(cache.key.shape) != expected:
                raise ValueError(
                    f"layer {i} cache is {tuple(cache.key.shape)}, expected {expected}"
                )

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        # host work only: the host twins give every length without a device sync
        q_lens, kv_lens = metadata.q_seq_lens_host.tolist(), metadata.kv_seq_lens_host.tolist()
        starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
        self.seqs = list(zip(starts, q_lens, kv_lens))
        self.metadata = metadata

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.metadata is None:
            raise RuntimeError("forward called before plan(metadata)")
        cache, m, spec = self.caches[layer_id], self.metadata, self.spec
        # KV write: every row whose slot is not -1; indexing honours k's and v's strides
        slots = m.slot_mapping.long()
        keep = slots >= 0
        cache.key.view(-1, spec.num_kv_heads, spec.head_dim)[slots[keep]] = k[keep]
        cache.value.view(-1, spec.num_kv_heads, spec.head_dim)[slots[keep]] = v[keep]
        out = torch.zeros_like(q)
        for i, (start, q_len, kv_len) in enumerate(self.seqs):
            # only the row's own pages: entries past them are unspecified
            pages = m.block_table[i]
            positions = torch.arange(kv_len, device=q.device)
            blocks = pages[positions // spec.block_size].long()
            keys = cache.key[blocks, positions % spec.block_size].float()  # [L, Hkv, D]
            values = cache.value[blocks, positions % spec.block_size].float()
            keys = keys.repeat_interleave(spec.group_size, dim=1)  # [L, H, D]
            values = values.repeat_interleave(spec.group_size, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].float(), keys)
            scores = scores * spec.softmax_scale
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            scores = scores.masked_fill(positions[None, :] > q_pos, float("-inf"))  # causal
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
            out[start : start + q_len] = attended.to(q.dtype)
        return out


class SkeletonCollective(Collective):
    """Collectives on one torch.distributed group; ranks are group ranks."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.group is None:
            return x
        parts = [
            torch.empty_like(x, memory_format=torch.contiguous_format)
            for _ in range(self.world_size)
        ]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if x.shape[dim] % self.world_size:
            raise ValueError(
                f"dim {dim} of size {x.shape[dim]} does not divide by {self.world_size} ranks"
            )
        return self.all_reduce(x).chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.group is None:
            return x
        out = x.clone()
        # torch takes a global rank: map the group rank the interface speaks
        dist.broadcast(out, src=dist.get_global_rank(self.group, src), group=self.group)
        return out

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


class SkeletonOps(DeviceOps):
    """float32 math, one rounding to the input's dtype at the end."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        scale = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
        return (x32 * scale * weight.float()).to(x.dtype)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        summed = (x.float() + residual.float()).to(x.dtype)  # the new residual, stored
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        rotary_dim = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache[positions.long()].float()[:, None, :].chunk(2, dim=-1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            rot = x32[..., :rotary_dim]
            if is_neox:  # channel i pairs with i + R/2
                a, b = rot.chunk(2, dim=-1)
                turned = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
            else:  # channel 2i pairs with 2i + 1
                a, b = rot[..., 0::2], rot[..., 1::2]
                turned = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
            return torch.cat([turned, x32[..., rotary_dim:]], dim=-1).to(x.dtype)

        return rotate(q), rotate(k)

    def sample(self, logits, temperature, top_k, top_p, generator=None) -> torch.Tensor:
        picks = []
        for row, t, k, p in zip(
            logits.float(), temperature.tolist(), top_k.tolist(), top_p.tolist()
        ):
            if t == 0.0:
                picks.append(int(row.argmax()))
                continue
            scaled = row / t
            if 0 < k < scaled.numel():  # top-k first, ties at the k-th value kept
                scaled = scaled.masked_fill(scaled < scaled.topk(k).values[-1], float("-inf"))
            probs = scaled.softmax(dim=-1)  # top-p on the temperature-scaled probabilities
            ordered, order = probs.sort(descending=True, stable=True)
            before = ordered.cumsum(0) - ordered  # mass ranked ahead of each token
            probs[order[before >= p]] = 0.0
            picks.append(int(torch.multinomial(probs / probs.sum(), 1, generator=generator)))
        return torch.tensor(picks, dtype=torch.long, device=logits.device)


class SkeletonPlatform(Platform):
    name = "skeleton"
    device_type = "cpu"
    dist_backend = "gloo"
    interface_version = 1  # the xhal interface version this file was written against
    async_scheduling = False  # forward runs synchronously
    capabilities = Capabilities(
        attention=AttentionCapabilities(
            dtypes=(torch.float32,),
            head_dims=(32, 64),  # any head dim works; these are the ones the suite tests
            any_head_dim=True,
            block_sizes=(16,),
        ),
        graphs=False,
        ops_dtypes=(torch.float32,),
        notes=("docs skeleton: plain torch, written from the interfaces only",),
    )

    def __init__(self) -> None:  # a real backend imports its device libraries here
        self._ops = SkeletonOps()

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def ops(self) -> SkeletonOps:
        return self._ops

    def attention_backend(self, spec: AttentionSpec) -> SkeletonAttention:
        self.capabilities.attention.check(spec)  # ValueError naming what is supported
        return SkeletonAttention(spec)

    def graph_runner(self) -> GraphRunner:
        raise NotImplementedError("the skeleton declares graphs=False")

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        return SkeletonCollective(group)

    def mem_get_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


platforms.register(SkeletonPlatform.name, SkeletonPlatform)
