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


class PagedIndexBuilder:
    """Builds a step's ``PagedIndex`` with numpy on the host and one pinned host-to-device copy.

    Staging buffers come from torch's caching pinned allocator, which does not reuse one until
    the copy that read it has completed, so a host running ahead never overwrites bytes in flight.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    @staticmethod
    def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
        host = torch.empty(values.size, dtype=torch.int32, pin_memory=True)
        host.numpy()[:] = values
        return host.to(device, non_blocking=True)

    def build(self, m: AttentionMetadata) -> PagedIndex:
        bs, b = self.block_size, m.num_seqs
        q_lens, kv_lens = m.q_seq_lens_host.numpy(), m.kv_seq_lens_host.numpy()
        # pinned, so that FlashInfer's uploads of them never stall on pageable memory
        qo_indptr, indptr = (torch.empty(b + 1, dtype=torch.int32, pin_memory=True) for _ in range(2))
        last_page_len = torch.empty(b, dtype=torch.int32, pin_memory=True)
        qo, ptr = qo_indptr.numpy(), indptr.numpy()
        qo[0] = ptr[0] = 0
        np.cumsum(q_lens, out=qo[1:])
        num_pages = (kv_lens + bs - 1) // bs
        np.cumsum(num_pages, out=ptr[1:])
        last_page_len.numpy()[:] = kv_lens - (num_pages - 1) * bs
        if m.paged_kv_indices is not None:  # the host built it (xLLM's CUDA builder does)
            indices = m.paged_kv_indices
        else:  # gather each row's first num_pages block ids; their positions are host-known
            table = m.block_table.contiguous()
            rows = np.repeat(np.arange(b, dtype=np.int32), num_pages)
            flat = rows * table.shape[1] + (np.arange(ptr[-1], dtype=np.int32) - ptr[rows])
            indices = table.view(-1).index_select(0, self._upload(flat, m.device))
        return PagedIndex(qo_indptr, indptr, indices, last_page_len, int(qo[-1]))


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
