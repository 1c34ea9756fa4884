"""CUDA attention on FlashInfer: its paged prefill / decode wrappers (the Triton fallback, used
without FlashInfer and by ``cuda-triton``, is ``triton_attention.py``).

One plan per step (per attention group) serves every layer. Decode batches use the decode wrapper
(tensor cores for GQA >= 4); prefill, chunked prefill and mixed batches use the paged prefill
wrapper with a bottom-right causal mask. Each captured decode bucket gets its own wrapper over
static buffers (``flashinfer_decode_bucket.py``) that the graph refreshes from the executor's
persistent metadata. The host-built page table and its staging are in
``flashinfer_page_table.py``; the one private FlashInfer call, pinned to 0.5.3, in
``flashinfer_0_5_3.py``.

Prefill runs FlashInfer's FA2 kernels by default, not FA3 (FlashInfer's choice on Hopper): the
tensor-core decode wrapper is built from the same FA2 module, so one JIT build per configuration
serves both, where FA3 adds a second one of several minutes per configuration. Pass
``prefill_backend="fa3"`` (or set ``XHAL_FLASHINFER_PREFILL=fa3``, read by ``xhal.env``) for FA3.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from xhal import env
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.metadata import AttentionMetadata, BatchKind
from xhal.platforms.cuda.flashinfer_decode_bucket import DecodeBucket
from xhal.platforms.cuda.flashinfer_page_table import PagedIndexBuilder, UploadFence
from xhal.platforms.cuda.kernels.kv_write import write_kv
from xhal.platforms.cuda.kernels.rotary_kv import rotary_write_kv


class FlashInferAttention(AttentionBackend):
    """``kv_write(k, v, k_cache, v_cache, slot_mapping)`` writes a step's keys and values (default:
    the Triton kernel); the tests' FlashInfer emulation on the CPU passes the reference's."""

    reads_kv_cu_seq_lens = False

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
        self.use_tensor_cores = (
            spec.group_size >= 4 if use_tensor_cores is None else use_tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend=prefill_backend
        )
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._common = {  # the plan arguments every wrapper gets
            "sm_scale": spec.softmax_scale,
            "window_left": (spec.sliding_window - 1) if spec.sliding_window else -1,
            "logits_soft_cap": spec.logits_soft_cap,
            "q_data_type": spec.dtype,
            "kv_data_type": spec.dtype,
        }
        self.buckets: dict[Hashable, DecodeBucket] = {}
        self.index_builder = PagedIndexBuilder(spec.block_size, pin=self._on_cuda)
        self._scheduled = UploadFence(
            self._on_cuda
        )  # the eager wrappers stage their schedule in pinned buffers
        self._caches: list[LayerCache] = []
        self._wrapper = None
        self._bucket: DecodeBucket | None = None  # the graph bucket of the last plan, if any
        self._slot_mapping: torch.Tensor | None = None
        self._num_real = 0

    def bind_kv_caches(self, caches: Sequence[LayerCache]) -> None:
        self._caches = normalize_layer_caches(caches)

    def plan(self, metadata: AttentionMetadata, graph_key: Hashable | None = None) -> None:
        m, s = metadata, self.spec
        if graph_key is not None:
            if m.kind != BatchKind.DECODE or m.num_tokens != m.num_seqs:
                raise ValueError(
                    "FlashInferAttention captures decode batches only; run others eagerly"
                )
            bucket = self.buckets.get(graph_key)
            if bucket is None:
                bucket = self.buckets[graph_key] = DecodeBucket(
                    self._fi, self.workspace, self.use_tensor_cores, m, s, graph_key
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
            self.prefill.plan(
                idx.qo_indptr,
                idx.indptr,
                ids,
                idx.last_page_len,
                *heads,
                causal=True,
                **self._common,
            )
        self.index_builder.release()
        self._scheduled.mark()
        self._bucket = None
        self._wrapper = self.decode if is_decode else self.prefill
        self._slot_mapping, self._num_real = m.slot_mapping, idx.num_real_tokens

    def _stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream() if self._on_cuda else None

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        cache = self._layer_cache(layer_id)
        self._kv_write(k, v, cache.key, cache.value, self._slot_mapping)
        return self._attend(q, cache)

    def forward_rotary(self, layer_id, q, k, v, positions, cos_sin_cache, is_neox):
        cache = self._layer_cache(layer_id)
        q = rotary_write_kv(
            positions, q, k, v, cos_sin_cache, is_neox, cache.key, cache.value, self._slot_mapping
        )
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
