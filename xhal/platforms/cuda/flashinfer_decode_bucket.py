"""One captured FlashInfer decode bucket: a decode wrapper over static device buffers that the
graph refreshes from the executor's persistent metadata."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.common.persistent import PersistentInputs
from xhal.platforms.cuda import flashinfer_0_5_3
from xhal.platforms.cuda.flashinfer_page_table import PinnedRing, UploadFence, page_positions


class DecodeBucket:
    """A FlashInfer decode wrapper (``use_cuda_graph=True``) for one graph key.

    The bucket's metadata tensors are the same at capture and at every replay (the
    ``AttentionBackend`` graph-key policy), so the graph reads them itself: the KV write reads
    ``slot_mapping``, and ``refresh`` (recorded by the bucket's first layer) gathers the page
    ids from ``block_table`` at uploaded positions and sets the last-page lengths to
    ``kv_seq_lens + offset``. Positions, offsets, the page indptr and FlashInfer's schedule are
    functions of the page counts alone (FlashInfer's C++ scheduler reads the page indptr, never
    the lengths), so the host uploads them and reruns the scheduler only when a sequence of the
    bucket gains or loses a page: one decode step in ``block_size`` at batch 1. On every other
    step ``plan`` compares page counts and queues no device work.

    The first plan, and every plan on FlashInfer versions ``flashinfer_0_5_3`` does not bind,
    goes through the wrapper's ``plan``; later ones call the scheduler directly.
    """

    def __init__(
        self,
        fi,
        workspace: torch.Tensor,
        use_tensor_cores: bool,
        m: AttentionMetadata,
        spec: AttentionSpec,
        graph_key: object = None,
    ) -> None:
        b, table = m.num_seqs, m.block_table
        i32 = {"dtype": torch.int32, "device": workspace.device}
        self.batch, self.block_size, self.persistent = b, spec.block_size, m
        self._captured = PersistentInputs(graph_key, m.slot_mapping, m.kv_seq_lens, m.block_table)
        max_pages = b * table.shape[1]
        self.meta = torch.zeros(
            2 * b + 1 + max_pages, **i32
        )  # indptr | offset | positions, uploaded
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
        self.fast = flashinfer_0_5_3.binds(fi)
        self.first_layer: int | None = None  # the layer whose forward records ``refresh``
        self._planned = False
        self._page_bytes = b""  # page counts of the uploaded layout and the schedule, as bytes
        self._kv_host = m.kv_seq_lens_host.numpy()  # the persistent host lengths, read in place
        self._dtype_tag = torch.empty(
            0, dtype=spec.dtype
        )  # the CUDA-core scheduler reads dtypes off it
        self.staging = PinnedRing(pin=workspace.is_cuda)
        self._scheduled = UploadFence(
            workspace.is_cuda
        )  # FlashInfer stages the schedule in one pinned buffer

    def plan(
        self, m: AttentionMetadata, spec: AttentionSpec, common: dict, stream: Callable[[], object]
    ) -> None:
        """``stream()``: the stream uploads go to, looked up only when there are any."""
        if m is self.persistent:  # the very metadata it was captured with: its tensors, too
            kv = self._kv_host
        else:
            self._captured.check(m.slot_mapping, m.kv_seq_lens, m.block_table)
            kv = m.kv_seq_lens_host.numpy()
        bs, b = self.block_size, self.batch
        pages = (kv + (bs - 1)) // bs
        # bytes compared: one call, where np.array_equal makes five (a plan a step, on the host)
        if self.fast and self._planned and pages.tobytes() == self._page_bytes:
            return  # the graph refreshes page ids and last-page lengths from the metadata itself
        nnz = int(pages.sum())
        if nnz > self.indices.numel():
            raise ValueError(
                f"decode bucket of {b} holds {self.indices.numel()} pages, the step has {nnz}"
            )
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
        self._page_bytes = pages.tobytes()

    def refresh(self) -> None:
        """This step's page ids and last-page lengths from the persistent metadata: device work,
        recorded in the graph by the bucket's first layer."""
        torch.index_select(self._table, 0, self._positions, out=self.indices)
        torch.add(self.persistent.kv_seq_lens, self._offset, out=self.last_page_len)

    def _schedule(
        self, m: AttentionMetadata, indptr: torch.Tensor, spec: AttentionSpec, common: dict
    ) -> None:
        """FlashInfer's scheduler for this bucket with the same ``common`` arguments the wrapper's
        ``plan`` got (a method of its own so tests and the host-timing benchmark can wrap it)."""
        flashinfer_0_5_3.schedule_decode(
            self.wrapper, self.qo_indptr_host, indptr, m.kv_seq_lens_host, self.batch, spec,
            common["window_left"], common["logits_soft_cap"], self._dtype_tag,
        )  # fmt: skip
