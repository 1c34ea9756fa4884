"""FlashInfer's page table built on the host: numpy into page-locked staging reused across steps,
each buffer fenced by an event until the uploads queued from it have run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xhal.interfaces.metadata import AttentionMetadata


def page_positions(
    num_pages: np.ndarray, indptr: np.ndarray, row_stride: int, col_stride: int, out: np.ndarray
) -> None:
    """Where each sequence's page ids sit in a block table flattened by its strides, in FlashInfer's
    page order: sequence r's j-th page (``indptr[r] + j`` of ``out``) at ``r * row_stride + j *
    col_stride``."""
    rows = np.repeat(np.arange(len(num_pages), dtype=np.int32), num_pages)
    out[:] = rows * row_stride + (np.arange(len(out), dtype=np.int32) - indptr[rows]) * col_stride


@dataclass
class PagedIndex:
    """FlashInfer's CSR page table of one eager step, built on the host in pinned memory."""

    qo_indptr: torch.Tensor  # int32 [B+1], cpu
    indptr: torch.Tensor  # int32 [B+1], cpu
    last_page_len: torch.Tensor  # int32 [B], cpu
    positions: torch.Tensor | None  # int32 [nnz], cpu: flat block-table positions of the page ids
    num_pages: int  # nnz
    num_real_tokens: int


class UploadFence:
    """An event after the last uploads queued from a reused page-locked buffer: ``wait`` before
    rewriting the buffer, ``mark`` once new uploads from it are queued. One CUDA event, re-recorded
    (creating one per step cost host time a graph step cannot spare). ``enabled=False`` (tensors
    not on a CUDA device, as under the tests' FlashInfer emulation) makes both no-ops: a device
    that runs on the host has nothing in flight."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def mark(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream``: the stream the uploads went to (default: the current one)."""
        if not self._enabled:
            return
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(stream)


class PinnedRing:
    """Page-locked int32 staging reused across steps, with no allocation on the hot path.

    ``slots`` buffers take turns. Before one is rewritten, the event recorded after its last
    uploads is waited on (free unless the host runs ``slots`` steps ahead of the device), so bytes
    still being copied are never overwritten.
    """

    def __init__(self, slots: int = 2, pin: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buffers = [torch.empty(0, dtype=torch.int32) for _ in range(slots)]
        self._fences = [UploadFence() for _ in range(slots)]
        self._slot = 0

    def acquire(self, size: int) -> torch.Tensor:
        """A pinned int32 buffer of ``size`` values; valid until the next ``release``."""
        self._slot = (self._slot + 1) % len(self._buffers)
        self._fences[self._slot].wait()
        if self._buffers[self._slot].numel() < size:  # grows a few times, then never again
            grown = max(size, 2 * self._buffers[self._slot].numel())
            self._buffers[self._slot] = torch.empty(grown, dtype=torch.int32, pin_memory=self._pin)
        return self._buffers[self._slot][:size]

    def release(self, stream: torch.cuda.Stream | None = None) -> None:
        """Mark the current buffer busy until the uploads queued so far (on ``stream``) have run."""
        if self._pin:
            self._fences[self._slot].mark(stream)


class PagedIndexBuilder:
    """Builds a step's ``PagedIndex`` with numpy into pinned staging.

    Page ids come from the block table on the device: the host knows each row's page count, so it
    writes the flat table positions to gather (``positions``) and the device gathers them with one
    ``index_select``. Call ``release`` once the uploads of the arrays handed out are queued.
    """

    def __init__(self, block_size: int, pin: bool | None = None) -> None:
        self.block_size = block_size
        self.staging = PinnedRing(pin=pin)

    def release(self, stream: torch.cuda.Stream | None = None) -> None:
        self.staging.release(stream)

    def build(self, m: AttentionMetadata) -> PagedIndex:
        bs, b = self.block_size, m.num_seqs
        q_lens, kv_lens = m.q_seq_lens_host.numpy(), m.kv_seq_lens_host.numpy()
        num_pages = (kv_lens + bs - 1) // bs
        nnz = int(num_pages.sum())
        gather = (
            m.paged_kv_indices is None
        )  # else the host built the page ids (xLLM's CUDA builder)
        buf = self.staging.acquire(3 * b + 2 + (nnz if gather else 0))
        host = buf.numpy()
        qo, ptr, last, flat = (
            host[: b + 1],
            host[b + 1 : 2 * b + 2],
            host[2 * b + 2 : 3 * b + 2],
            host[3 * b + 2 :],
        )
        qo[0] = 0
        np.cumsum(q_lens, out=qo[1:])
        if m.paged_kv_indptr_host is not None and m.paged_kv_last_page_len_host is not None:
            # the host built FlashInfer's CSR arrays (xLLM's CUDA builder does): staged, not rebuilt
            ptr[:] = m.paged_kv_indptr_host.numpy()
            last[:] = m.paged_kv_last_page_len_host.numpy()
        else:
            ptr[0] = 0
            np.cumsum(num_pages, out=ptr[1:])
            last[:] = kv_lens - (num_pages - 1) * bs
        if gather:  # positions in the contiguous table (page_ids makes it contiguous)
            page_positions(num_pages, ptr, m.block_table.shape[1], 1, out=flat)
        return PagedIndex(
            qo_indptr=buf[: b + 1],
            indptr=buf[b + 1 : 2 * b + 2],
            last_page_len=buf[2 * b + 2 : 3 * b + 2],
            positions=buf[3 * b + 2 :] if gather else None,
            num_pages=nnz,
            num_real_tokens=int(qo[b]),
        )

    @staticmethod
    def page_ids(m: AttentionMetadata, idx: PagedIndex) -> torch.Tensor:
        """The step's page ids on the device, gathered from the block table (or the host's)."""
        if idx.positions is None:
            return m.paged_kv_indices
        positions = idx.positions.to(m.device, non_blocking=True)
        return m.block_table.contiguous().view(-1).index_select(0, positions)
