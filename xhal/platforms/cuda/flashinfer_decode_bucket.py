"""One captured FlashInfer decode bucket: a decode wrapper over static device buffers that the
graph refreshes from the executor's persistent metadata."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.metadata import AttentionMetadata
from xhal.platforms.common.persistent import PersistentInputs
from xhal.platforms.cuda import flashinfer_0_5_3
from xhal.platforms.cuda.flashinfer_page_table import UploadFence


@functools.cache
def page_counts(block_size: int, max_pages: int) -> np.ndarray:
    """Pages of every KV length from 0 to ``max_pages * block_size``, as a look-up table (read
    only, shared by the buckets of one shape)."""
    counts = (np.arange(max_pages * block_size + 1, dtype=np.int32) + block_size - 1) // block_size
    counts.flags.writeable = False
    return counts


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
        self._pages_of = page_counts(spec.block_size, table.shape[1])  # KV length -> pages
        # every page's position in the flat table, [b, width], and the column numbers: a
        # plan's positions are the entries of the rows' first pages, in row order (one compare
        # and one masked read, where building them per row took three times as long at 64 rows)
        rows = np.arange(b, dtype=np.int64)[:, None] * table.stride(0)
        self._columns = np.arange(table.shape[1], dtype=np.int32)[None]
        self._grid = (rows + self._columns * table.stride(1)).astype(np.int32)
        self._kv_host = m.kv_seq_lens_host.numpy()  # the persistent host lengths, read in place
        self._dtype_tag = torch.empty(
            0, dtype=spec.dtype
        )  # the CUDA-core scheduler reads dtypes off it
        # one pinned buffer for the page layout a plan uploads, and one fence after the plan's
        # uploads (ours, then FlashInfer's of its schedule, which it stages in one pinned
        # buffer of its own): one event record and at most one wait per plan that uploads
        self._host_meta = torch.zeros(self.meta.numel(), dtype=torch.int32,
                                      pin_memory=workspace.is_cuda)  # fmt: skip
        self._host_np, self._host_indptr = self._host_meta.numpy(), self._host_meta[: b + 1]
        self._scheduled = UploadFence(workspace.is_cuda)

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
        try:  # one look-up, where the arithmetic is two numpy calls (a plan a step, on the host)
            pages = self._pages_of.take(kv)
        except IndexError:
            raise ValueError(
                f"decode bucket of {b}: a KV length in {kv.tolist()} is past the "
                f"{self._pages_of.size - 1} tokens its block table holds"
            ) from None
        # bytes compared: one call, where np.array_equal makes five (a plan a step, on the host)
        if self.fast and self._planned and pages.tobytes() == self._page_bytes:
            return  # the graph refreshes page ids and last-page lengths from the metadata itself
        nnz = int(pages.sum())
        if nnz > self.indices.numel():
            raise ValueError(
                f"decode bucket of {b} holds {self.indices.numel()} pages, the step has {nnz}"
            )
        self._scheduled.wait()  # the last plan's uploads have run: the host buffer is free
        count, host = 2 * b + 1 + nnz, self._host_np
        indptr, offset = host[: b + 1], host[b + 1 : 2 * b + 1]
        indptr[0] = 0
        np.cumsum(pages, out=indptr[1:])
        offset[:] = bs - pages * bs  # last-page length = kv length + offset
        host[2 * b + 1 : count] = self._grid[self._columns < pages[:, None]]
        upload_stream = stream()
        self.meta[:count].copy_(self._host_meta[:count], non_blocking=True)
        if self.fast and self._planned:
            self._schedule(m, self._host_indptr, spec, common)
        else:
            ids = torch.index_select(self._table, 0, self._positions[:nnz])
            last = torch.from_numpy(kv + offset)
            heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim, bs)
            self.wrapper.plan(self._host_indptr, ids, last, *heads, **common)
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
