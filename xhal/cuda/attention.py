"""CUDA attention: FlashInfer's paged prefill / decode wrappers, or the Triton fallback.

One plan per step (per attention group) serves every layer. Decode batches use the decode wrapper
(tensor cores for GQA >= 4); prefill, chunked prefill and mixed batches use the paged prefill
wrapper with a bottom-right causal mask. Each captured decode bucket gets its own wrapper over
static buffers (``use_cuda_graph=True``) that the graph refreshes from the executor's persistent
metadata; the host re-plans it only when a page count changes. The host-built page table and its
staging are in ``page_table.py``.

Prefill runs FlashInfer's FA2 kernels by default, not FA3 (FlashInfer's choice on Hopper): the
tensor-core decode wrapper is built from the same FA2 module, so one JIT build per configuration
serves both, where FA3 adds a second one of several minutes per configuration. Pass
``prefill_backend="fa3"`` (or set ``XHAL_FLASHINFER_PREFILL=fa3``) for FA3.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xhal import env
from xhal.cuda.kernels.kv_write import write_kv
from xhal.cuda.kernels.paged_attention import paged_attention
from xhal.cuda.kernels.rotary_kv import rotary_write_kv
from xhal.cuda.page_table import PagedIndexBuilder, PinnedRing, UploadFence, page_positions
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata, BatchKind

# FlashInfer versions whose wrapper internals the bucket fast plan was checked against
_FAST_PLAN_VERSIONS = ("0.5.3",)


class _DecodeBucket:
    """One captured decode bucket: a FlashInfer decode wrapper over static device buffers that the
    graph refreshes from the executor's persistent metadata.

    A graph bucket's metadata tensors are the same at capture and at every replay (the
    ``AttentionBackend`` contract for graph keys), so the graph reads them itself: the KV write
    reads ``slot_mapping``, and ``refresh`` (recorded by the bucket's first layer) gathers the page
    ids from ``block_table`` at uploaded positions and sets the last-page lengths to
    ``kv_seq_lens + offset``. Positions, offsets, the page indptr and FlashInfer's schedule are
    functions of the page counts alone (FlashInfer's C++ scheduler reads the page indptr, never
    the lengths), so the host uploads them and reruns the scheduler only when a sequence of the
    bucket gains or loses a page: one decode step in ``block_size`` at batch 1. On every other
    step ``plan`` compares page counts and queues no device work.

    The first plan, and every plan on FlashInfer versions outside ``_FAST_PLAN_VERSIONS``, goes
    through the wrapper's ``plan``; later ones call the scheduler directly, since the wrapper's
    Python re-derives on every call what is fixed for a bucket.
    """

    def __init__(
        self, fi, workspace: torch.Tensor, use_tensor_cores: bool, m: AttentionMetadata, spec: AttentionSpec
    ) -> None:
        b, table = m.num_seqs, m.block_table
        i32 = dict(dtype=torch.int32, device=workspace.device)
        self.batch, self.block_size, self.persistent = b, spec.block_size, m
        self._captured = _addresses(m.slot_mapping, m.kv_seq_lens, m.block_table)  # what the graph reads
        max_pages = b * table.shape[1]
        self.meta = torch.zeros(2 * b + 1 + max_pages, **i32)  # indptr | offset | positions, uploaded
        self._offset, self._positions = self.meta[b + 1 : 2 * b + 1], self.meta[2 * b + 1 :]
        self.last_page_len = torch.ones(b, **i32)
        self.indices = torch.zeros(max_pages, **i32)
        # every entry of the bucket's block table as one flat view, whatever its strides
        extent = (b - 1) * table.stride(0) + (table.shape[1] - 1) * table.stride(1) + 1
        self._table = table.as_strided((extent,), (1,))
        self.qo_indptr_host = torch.arange(b + 1, dtype=torch.int32)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=self.meta[: b + 1],
            paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )
        self.fast = getattr(fi, "__version__", "") in _FAST_PLAN_VERSIONS
        self.first_layer: int | None = None  # the layer whose forward records ``refresh``
        self._planned = False
        self._pages: np.ndarray | None = None  # page counts of the uploaded layout and the schedule
        self._dtype_tag = torch.empty(0, dtype=spec.dtype)  # the CUDA-core scheduler reads dtypes off it
        self.staging = PinnedRing(pin=workspace.is_cuda)
        self._scheduled = UploadFence(workspace.is_cuda)  # FlashInfer stages the schedule in one pinned buffer

    def plan(self, m: AttentionMetadata, spec: AttentionSpec, common: dict, stream: Callable[[], object]) -> None:
        """``stream()``: the stream uploads go to, looked up only when there are any."""
        if _addresses(m.slot_mapping, m.kv_seq_lens, m.block_table) != self._captured:
            raise ValueError(_NOT_PERSISTENT)
        bs, b = self.block_size, self.batch
        kv = m.kv_seq_lens_host.numpy()
        pages = (kv + (bs - 1)) // bs
        if self.fast and self._planned and np.array_equal(pages, self._pages):
            return  # the graph refreshes page ids and last-page lengths from the metadata itself
        nnz = int(pages.sum())
        if nnz > self.indices.numel():
            raise ValueError(f"decode bucket of {b} holds {self.indices.numel()} pages, the step has {nnz}")
        buf = self.staging.acquire(2 * b + 1 + nnz)
        host = buf.numpy()
        indptr, offset = host[: b + 1], host[b + 1 : 2 * b + 1]
        indptr[0] = 0
        np.cumsum(pages, out=indptr[1:])
        offset[:] = bs - pages * bs  # last-page length = kv length + offset
        row_stride, col_stride = m.block_table.stride()
        page_positions(pages, indptr, row_stride, col_stride, out=host[2 * b + 1 :])
        upload_stream = stream()
        self.meta[: buf.numel()].copy_(buf, non_blocking=True)
        self.staging.release(upload_stream)
        self._scheduled.wait()
        if self.fast and self._planned:
            self._schedule(m, buf[: b + 1], spec, common)
        else:
            ids = torch.index_select(self._table, 0, self._positions[:nnz])
            last = torch.from_numpy(kv + offset)
            heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim, bs)
            self.wrapper.plan(buf[: b + 1], ids, last, *heads, **common)
            self._planned = True
        self._scheduled.mark(upload_stream)
        self._pages = pages.copy()

    def refresh(self) -> None:
        """This step's page ids and last-page lengths from the persistent metadata: device work,
        recorded in the graph by the bucket's first layer."""
        torch.index_select(self._table, 0, self._positions, out=self.indices)
        torch.add(self.persistent.kv_seq_lens, self._offset, out=self.last_page_len)

    def _schedule(self, m: AttentionMetadata, indptr: torch.Tensor, spec: AttentionSpec, common: dict) -> None:
        """FlashInfer's scheduler for this bucket, as the wrapper's ``plan`` calls it with
        ``use_cuda_graph=True`` (0.5.3) and the same ``common`` arguments; the captured kernels
        read its output from the int workspace."""
        w, b, window = self.wrapper, self.batch, common["window_left"]
        buffers = (w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
        if w.use_tensor_cores:
            w._plan_info = w._cached_module.plan(
                *buffers, self.qo_indptr_host, indptr, m.kv_seq_lens_host, b, b,
                spec.num_heads, spec.num_kv_heads, spec.block_size, True, spec.head_dim, spec.head_dim,
                False, window, -1, False, 0,
            )
        else:
            w._plan_info = w._cached_module.plan(
                *buffers, indptr, b, spec.num_heads, spec.num_kv_heads, spec.block_size, True,
                window, common["logits_soft_cap"] or 0.0, spec.head_dim, spec.head_dim,
                self._dtype_tag, self._dtype_tag,
            )


def _addresses(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


_NOT_PERSISTENT = (
    "a graph bucket reads the metadata tensors it was captured with: plan it with the same "
    "(persistent) device tensors, rewritten in place, at every replay"
)


class FlashInferAttention(AttentionBackend):
    """``kv_write(k, v, k_cache, v_cache, slot_mapping)`` writes a step's keys and values (default:
    the Triton kernel); the tests' FlashInfer emulation on the CPU passes the reference's."""

    def __init__(
        self, spec: AttentionSpec, workspace: torch.Tensor, use_tensor_cores: bool | None = None,
        prefill_backend: str = "fa2", kv_write: Callable[..., None] = write_kv,
    ) -> None:
        super().__init__(spec)
        import flashinfer

        self._fi = flashinfer
        self.workspace = workspace
        self._kv_write = kv_write
        # rotary fused into the KV write: our Triton kernel, on a GPU (the CPU emulation of the
        # tests passes its own kv_write and keeps the two launches)
        self.fuses_rotary = workspace.is_cuda and kv_write is write_kv and env.cuda_fused()
        self._on_cuda = workspace.is_cuda
        # FlashInfer's advice: tensor-core decode pays from a GQA group of 4 up
        self.use_tensor_cores = spec.group_size >= 4 if use_tensor_cores is None else use_tensor_cores
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=prefill_backend)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._common = dict(  # the plan arguments every wrapper gets
            sm_scale=spec.softmax_scale,
            window_left=(spec.sliding_window - 1) if spec.sliding_window else -1,
            logits_soft_cap=spec.logits_soft_cap,
            q_data_type=spec.dtype,
            kv_data_type=spec.dtype,
        )
        self.buckets: dict[Hashable, _DecodeBucket] = {}
        self.index_builder = PagedIndexBuilder(spec.block_size, pin=self._on_cuda)
        self._scheduled = UploadFence(self._on_cuda)  # the eager wrappers stage their schedule in pinned buffers
        self._caches: list[LayerCache] = []
        self._wrapper = None
        self._bucket: _DecodeBucket | None = None  # the graph bucket of the last plan, if any
        self._slot_mapping: torch.Tensor | None = None
        self._num_real = 0

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        m, s = metadata, self.spec
        if graph_key is not None:
            if m.kind != BatchKind.DECODE or m.num_tokens != m.num_seqs:
                raise ValueError("FlashInferAttention captures decode batches only; run others eagerly")
            bucket = self.buckets.get(graph_key)
            if bucket is None:
                bucket = self.buckets[graph_key] = _DecodeBucket(
                    self._fi, self.workspace, self.use_tensor_cores, m, s
                )
            bucket.plan(m, s, self._common, self._stream)
            self._bucket, self._wrapper, self._num_real = bucket, bucket.wrapper, m.num_seqs
            self._slot_mapping = m.slot_mapping  # the bucket's persistent slots
            return
        idx = self.index_builder.build(m)
        is_decode = m.kind == BatchKind.DECODE and idx.num_real_tokens == m.num_seqs
        self._scheduled.wait()
        ids = self.index_builder.page_ids(m, idx)
        heads = (s.num_heads, s.num_kv_heads, s.head_dim, s.block_size)
        if is_decode:
            self.decode.plan(idx.indptr, ids, idx.last_page_len, *heads, **self._common)
        else:
            self.prefill.plan(idx.qo_indptr, idx.indptr, ids, idx.last_page_len, *heads, causal=True, **self._common)
        self.index_builder.release()
        self._scheduled.mark()
        self._bucket = None
        self._wrapper = self.decode if is_decode else self.prefill
        self._slot_mapping, self._num_real = m.slot_mapping, idx.num_real_tokens

    def _stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream() if self._on_cuda else None

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._layer_cache(layer_id)
        self._kv_write(k, v, cache.key, cache.value, self._slot_mapping)
        return self._attend(q, cache)

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        cache = self._layer_cache(layer_id)
        q = rotary_write_kv(positions, q, k, v, cos_sin_cache, is_neox, cache.key, cache.value, self._slot_mapping)
        return self._attend(q, cache)

    def _layer_cache(self, layer_id: int) -> LayerCache:
        bucket = self._bucket
        if bucket is not None and bucket.first_layer in (None, layer_id):
            bucket.first_layer = layer_id  # the graph's first attention layer refreshes the bucket
            bucket.refresh()
        return self._caches[layer_id]

    def _attend(self, q: torch.Tensor, cache: LayerCache) -> torch.Tensor:
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
    q_lens_host: np.ndarray | None = None  # a graph plan's query lengths, which fix token_seq


class TritonAttention(AttentionBackend):
    """The fallback: one Triton kernel for every batch kind, any float dtype.

    A graph bucket's plan reads the persistent metadata directly (the ``AttentionBackend``
    contract for graph keys) and rebuilds its one own input, each token's sequence, only when the
    query lengths change: a decode replay's plan queues no device work."""

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
        seq_ids = torch.repeat_interleave(torch.arange(m.num_seqs, dtype=torch.int32), m.q_seq_lens_host)
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
            plan = self._graph_plans[graph_key] = _TritonPlan(self._token_seq(m), *tables, q_lens.copy())
        elif _addresses(*tables) != _addresses(plan.q_cu_seq_lens, plan.kv_seq_lens, plan.block_table, plan.slot_mapping):
            raise ValueError(_NOT_PERSISTENT)
        elif not np.array_equal(q_lens, plan.q_lens_host):
            plan.token_seq.copy_(self._token_seq(m), non_blocking=True)
            plan.q_lens_host = q_lens.copy()
        self._plan = plan

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._caches[layer_id]
        write_kv(k, v, cache.key, cache.value, self._plan.slot_mapping)
        return self._attend(q, cache)

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        cache = self._caches[layer_id]
        q = rotary_write_kv(positions, q, k, v, cos_sin_cache, is_neox, cache.key, cache.value, self._plan.slot_mapping)
        return self._attend(q, cache)

    def _attend(self, q: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        p, s = self._plan, self.spec
        out = torch.zeros_like(q)
        return paged_attention(
            q, cache.key, cache.value, p.token_seq, p.q_cu_seq_lens, p.kv_seq_lens, p.block_table,
            s.softmax_scale, s.logits_soft_cap or 0.0, s.sliding_window or 0, out,
        )
