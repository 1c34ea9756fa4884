"""Per-sequence host lengths -> ``AttentionMetadata`` whose every tensor is a host tensor.

For a host that hands a step to ``ModelExecutor.execute`` as it built it: the executor stages a
decode-graph step from host tensors in one pinned copy of its own and moves any other step in one
packed upload (``xhal.executor.host_step``), so an upload here first would only add a second
device copy. Every tensor is a zero-copy ``torch.from_numpy`` view of an array made with numpy
(a decode step holds a few ints per sequence, for which each torch call would cost more than the
values do). No value checks: the caller built the lengths; ``validate()`` is there for tests.
"""

from __future__ import annotations

import numpy as np
import torch

from xhal.adapter.kind import derive_kind
from xhal.adapter.to_xllm import cumulative, padded_table, paged_kv
from xhal.interfaces.metadata import AttentionMetadata, BatchKind


def host_metadata(
    q_seq_lens: np.ndarray,
    kv_seq_lens: np.ndarray,
    block_table: list[list[int]] | np.ndarray,
    slot_mapping: np.ndarray,
    *,
    block_size: int | None = None,
    kind: BatchKind | None = None,
) -> AttentionMetadata:
    """The step's metadata on the host: int32 numpy ``q_seq_lens`` / ``kv_seq_lens`` ``[B]``
    (kv includes this step's tokens), ``block_table`` rows (ragged rows padded with 0) and
    ``slot_mapping`` ``[T]``. With ``block_size`` the paged-KV arrays and their host twins are
    added, as xLLM's CUDA builder adds them, for the backends that plan on them. ``kind``
    defaults to ``derive_kind`` of the lengths (a caller that knows it saves the look)."""
    q, kv = q_seq_lens, kv_seq_lens
    b = q.size
    table = padded_table(block_table, b)
    kind = derive_kind(q, kv) if kind is None else kind
    decode = kind == BatchKind.DECODE
    # one token per sequence: the query sums are a range
    q_cu = np.arange(b + 1, dtype=np.int32) if decode else cumulative(q)
    host = torch.from_numpy
    paged = {}
    if block_size is not None:
        arrays = paged_kv(kv, table, block_size)
        paged = {name: host(a) for name, a in arrays.items()}
        paged["paged_kv_indptr_host"] = paged["paged_kv_indptr"]
        paged["paged_kv_last_page_len_host"] = paged["paged_kv_last_page_len"]
    q_host, kv_host = host(q), host(kv)
    return AttentionMetadata(
        kind=kind,
        num_seqs=b,
        num_tokens=slot_mapping.size,
        max_query_len=1 if decode else int(q.max()) if b else 0,
        max_seq_len=int(kv.max()) if b else 0,
        q_cu_seq_lens=host(q_cu),
        kv_cu_seq_lens=host(cumulative(kv)),
        q_seq_lens=q_host,
        kv_seq_lens=kv_host,
        q_seq_lens_host=q_host,
        kv_seq_lens_host=kv_host,
        block_table=host(table),
        slot_mapping=host(slot_mapping),
        **paged,
    )
