"""CUDA attention: FlashInfer's paged prefill / decode wrappers, or the Triton fallback.

One plan per step (per attention group) serves every layer. Decode batches use the decode wrapper
(tensor cores for GQA >= 4); prefill, chunked prefill and mixed batches use the paged prefill
wrapper with a bottom-right causal mask. Each captured decode bucket gets its own wrapper over
static buffers (``use_cuda_graph=True``), re-planned on the host before every replay.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xhal.cuda.kernels.kv_write import write_kv
from xhal.cuda.kernels.paged_attention import paged_attention
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata, BatchKind


@dataclass
class PagedIndex:
    """FlashInfer's CSR page table of one step: host indptr / last-page lengths, device indices."""

    qo_indptr: torch.Tensor  # int32 [B+1], cpu
    indptr: torch.Tensor  # int32 [B+1], cpu
    indices: torch.Tensor  # int32 [indptr[-1]], device
    last_page_len: torch.Tensor  # int32 [B], cpu
    num_real_tokens: int


class PinnedRing:
    """Page-locked int32 staging reused across steps, with no allocation on the hot path.

    ``slots`` buffers take turns. Before one is rewritten, the event recorded after its last
    uploads is waited on (free unless the host runs ``slots`` steps ahead of the device), so bytes
    still being copied are never overwritten.
    """

    def __init__(self, slots: int = 2) -> None:
        self._buffers = [torch.empty(0, dtype=torch.int32) for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._slot = 0

    def acquire(self, size: int) -> np.ndarray:
        """A pinned buffer of ``size`` int32 values, as a numpy view; valid until ``release``."""
        self._slot = (self._slot + 1) % len(self._buffers)
        if self._events[self._slot] is not None:
            self._events[self._slot].synchronize()
        if self._buffers[self._slot].numel() < size:  # grows a few times, then never again
            self._buffers[self._slot] = torch.empty(max(size, 2 * self._buffers[self._slot].numel()), dtype=torch.int32, pin_memory=True)
        return self._buffers[self._slot].numpy()[:size]

    def tensor(self, view: np.ndarray) -> torch.Tensor:
        """The pinned tensor behind a view handed out by ``acquire``."""
        return torch.from_numpy(view)

    def release(self) -> None:
        """Mark the current buffer busy until the uploads queued so far have run."""
        event = torch.cuda.Event()
        event.record()
        self._events[self._slot] = event


class PagedIndexBuilder:
    """Builds a step's ``PagedIndex`` with numpy into pinned staging and one host-to-device copy.

    The host arrays handed to FlashInfer's ``plan`` are pinned, so its uploads of them never stall
    on pageable memory; call ``release`` once ``plan`` has queued those uploads.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.staging = PinnedRing()

    def release(self) -> None:
        self.staging.release()

    def build(self, m: AttentionMetadata) -> PagedIndex:
        bs, b = self.block_size, m.num_seqs
        q_lens, kv_lens = m.q_seq_lens_host.numpy(), m.kv_seq_lens_host.numpy()
        num_pages = (kv_lens + bs - 1) // bs
        nnz = int(num_pages.sum())
        host_indices = m.paged_kv_indices is None
        buf = self.staging.acquire(3 * b + 2 + (nnz if host_indices else 0))
        qo, ptr, last, flat = np.split(buf, [b + 1, 2 * b + 2, 3 * b + 2])
        qo[0] = ptr[0] = 0
        np.cumsum(q_lens, out=qo[1:])
        np.cumsum(num_pages, out=ptr[1:])
        last[:] = kv_lens - (num_pages - 1) * bs
        if not host_indices:  # the host built it (xLLM's CUDA builder does)
            indices = m.paged_kv_indices
        else:  # gather each row's first num_pages block ids; their positions are host-known
            table = m.block_table.contiguous()
            rows = np.repeat(np.arange(b, dtype=np.int32), num_pages)
            flat[:] = rows * table.shape[1] + (np.arange(nnz, dtype=np.int32) - ptr[rows])
            upload = self.staging.tensor(flat).to(m.device, non_blocking=True)
            indices = table.view(-1).index_select(0, upload)
        t = self.staging.tensor
        return PagedIndex(t(qo), t(ptr), indices, t(last), int(qo[-1]))


class FlashInferAttention(AttentionBackend):
    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor, use_tensor_cores: bool | None = None) -> None:
        super().__init__(spec)
        import flashinfer

        self._fi = flashinfer
        self.workspace = workspace
        # FlashInfer's advice: tensor-core decode pays from a GQA group of 4 up
        self.use_tensor_cores = spec.group_size >= 4 if use_tensor_cores is None else use_tensor_cores
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.graph_decode: dict[Hashable, object] = {}
        self.graph_slots: dict[Hashable, torch.Tensor] = {}  # static slot mapping per captured bucket
        self.index_builder = PagedIndexBuilder(spec.block_size)
        self._caches: list[LayerCache] = []
        self._wrapper = None
        self._slot_mapping: torch.Tensor | None = None
        self._num_real = 0

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    def _common(self) -> dict:
        s = self.spec
        return dict(
            sm_scale=s.softmax_scale,
            window_left=(s.sliding_window - 1) if s.sliding_window else -1,
            logits_soft_cap=s.logits_soft_cap,
            q_data_type=s.dtype,
            kv_data_type=s.dtype,
        )

    def _graph_wrapper(self, key: Hashable, m: AttentionMetadata):
        if key not in self.graph_decode:
            b, device = m.num_seqs, m.device
            i32 = dict(dtype=torch.int32, device=device)
            self.graph_decode[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(b + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(b * m.block_table.shape[1], **i32),
                paged_kv_last_page_len_buffer=torch.ones(b, **i32),
            )
        return self.graph_decode[key]

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        s, idx = self.spec, self.index_builder.build(metadata)
        is_decode = metadata.kind == BatchKind.DECODE and idx.num_real_tokens == metadata.num_seqs
        if graph_key is not None:
            if not is_decode:
                raise ValueError("FlashInferAttention captures decode batches only; run others eagerly")
            wrapper = self._graph_wrapper(graph_key, metadata)
        else:
            wrapper = self.decode if is_decode else self.prefill
        heads = (s.num_heads, s.num_kv_heads, s.head_dim, s.block_size)
        if is_decode:
            wrapper.plan(idx.indptr, idx.indices, idx.last_page_len, *heads, **self._common())
        else:
            wrapper.plan(idx.qo_indptr, idx.indptr, idx.indices, idx.last_page_len, *heads, causal=True, **self._common())
        self.index_builder.release()
        slots = metadata.slot_mapping
        if graph_key is not None:  # the captured KV write reads this bucket's own static buffer
            if graph_key not in self.graph_slots:
                self.graph_slots[graph_key] = slots.clone()
            slots = self.graph_slots[graph_key].copy_(slots, non_blocking=True)
        self._wrapper, self._slot_mapping, self._num_real = wrapper, slots, idx.num_real_tokens

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._caches[layer_id]
        write_kv(k, v, cache.key, cache.value, self._slot_mapping)
        n = self._num_real
        if n == q.shape[0]:
            return self._wrapper.run(q, (cache.key, cache.value))
        out = torch.zeros_like(q)  # padded rows stay zero
        out[:n] = self._wrapper.run(q[:n], (cache.key, cache.value))
        return out


@dataclass
class _TritonPlan:
    token_seq: torch.Tensor
    q_cu_seq_lens: torch.Tensor
    kv_seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class TritonAttention(AttentionBackend):
    """The fallback: one Triton kernel for every batch kind, any float dtype."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._caches: list[LayerCache] = []
        self._plan: _TritonPlan | None = None
        self._graph_plans: dict[Hashable, _TritonPlan] = {}

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        m = metadata
        seq_ids = torch.repeat_interleave(torch.arange(m.num_seqs, dtype=torch.int32), m.q_seq_lens_host)
        pad = torch.full((m.num_tokens - seq_ids.shape[0],), -1, dtype=torch.int32)
        token_seq = torch.cat([seq_ids, pad]).to(m.device, non_blocking=True)
        live = _TritonPlan(token_seq, m.q_cu_seq_lens, m.kv_seq_lens, m.block_table, m.slot_mapping)
        if graph_key is None:
            self._plan = live
            return
        if graph_key not in self._graph_plans:
            self._graph_plans[graph_key] = _TritonPlan(*(t.clone() for t in vars(live).values()))
        else:
            for name, t in vars(live).items():
                getattr(self._graph_plans[graph_key], name).copy_(t, non_blocking=True)
        self._plan = self._graph_plans[graph_key]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, p, s = self._caches[layer_id], self._plan, self.spec
        write_kv(k, v, cache.key, cache.value, p.slot_mapping)
        out = torch.zeros_like(q)
        return paged_attention(
            q, cache.key, cache.value, p.token_seq, p.q_cu_seq_lens, p.kv_seq_lens, p.block_table,
            s.softmax_scale, s.logits_soft_cap or 0.0, s.sliding_window or 0, out,
        )
