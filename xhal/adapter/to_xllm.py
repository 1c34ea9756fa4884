"""Per-sequence host lengths -> xLLM's metadata layout in either convention, as C++ emits it.

Built once per step with numpy (no per-row torch ops, no Python lists of tensors) and sent to the
device in one packed copy together with whatever other int32 arrays the host's step carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from xhal.adapter.conventions import is_cumulative, parse_convention
from xhal.adapter.kind import derive_kind
from xhal.adapter.upload import upload_packed
from xhal.interfaces.metadata import BatchKind

IntsLike = Sequence[int] | np.ndarray | torch.Tensor


def to_xllm(
    q_seq_lens: IntsLike,
    kv_seq_lens: IntsLike,
    block_table: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
    slot_mapping: IntsLike,
    convention: str,
    device: torch.device | str,
    *,
    block_size: int | None = None,
    graph_mode: bool = False,
    kind: BatchKind | None = None,
) -> dict[str, Any]:
    """Build the dict of ``PyAttentionMetadataView`` fields xLLM's builder would emit.

    Inputs are host values: per-sequence ``q_seq_lens``/``kv_seq_lens`` ``[B]`` (kv includes this
    step's tokens), ``block_table`` rows (ragged rows are padded with 0) and ``slot_mapping``
    ``[T]`` (``-1`` for padding tokens). The lengths are laid out in ``convention`` (``"npu"`` or
    ``"cuda"``); ``graph_mode`` (npu only) drops the leading 0 of ``q_cu_seq_lens``, as xLLM's ACL
    graph mode does.
    With ``block_size``, ``paged_kv_indptr``/``paged_kv_indices``/``paged_kv_last_page_len`` (and
    their ``*_host`` twins of indptr and last page length) and ``qo_indptr`` are added as xLLM's
    CUDA builder adds them (last page length is ``kv_len % block_size`` or ``block_size``).
    ``kind`` defaults to ``derive_kind`` of the lengths. Device tensors reach ``device`` in one
    copy; feed the result to ``from_xllm``.
    """
    view, _ = to_xllm_step(
        q_seq_lens, kv_seq_lens, block_table, slot_mapping, convention, device,
        block_size=block_size, graph_mode=graph_mode, kind=kind,
    )
    view["kv_seq_lens_host_values"] = view["kv_seq_lens_host"].tolist()
    return view


def to_xllm_step(
    q_seq_lens: IntsLike,
    kv_seq_lens: IntsLike,
    block_table: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
    slot_mapping: IntsLike,
    convention: str,
    device: torch.device | str,
    *,
    block_size: int | None = None,
    graph_mode: bool = False,
    kind: BatchKind | None = None,
    extra: Mapping[str, IntsLike] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``to_xllm``'s view (without the ``kv_seq_lens_host_values`` list) and, on the device, the
    ``extra`` host int32 arrays (token ids, positions, sampled rows...) by the same names: the
    view's device tensors and the extras travel in one packed host-to-device copy."""
    conv = parse_convention(convention)
    q, kv = _host_ints("q_seq_lens", q_seq_lens), _host_ints("kv_seq_lens", kv_seq_lens)
    if q.size != kv.size:
        raise ValueError(f"q_seq_lens has {q.size} sequences but kv_seq_lens has {kv.size}")
    if q.size and ((q < 0).any() or (q > kv).any()):
        raise ValueError(
            f"expected 0 <= q_seq_lens <= kv_seq_lens, got {q.tolist()} and {kv.tolist()}"
        )
    if graph_mode and conv != "npu":
        raise ValueError(
            "graph_mode (q_cu_seq_lens without leading 0) exists only in convention 'npu'"
        )
    table = padded_table(block_table, q.size)
    slots = _host_ints("slot_mapping", slot_mapping)
    kind = derive_kind(q, kv) if kind is None else BatchKind(kind)
    q_cu, kv_cu = cumulative(q), cumulative(kv)

    host: dict[str, np.ndarray] = {
        "slot_mapping": slots,
        "block_table": table,
        "q_cu": q_cu,
        "kv_cu": kv_cu,
    }
    if not is_cumulative(conv):
        host |= {"q": q, "kv": kv}
    paged = paged_kv(kv, table, block_size) if block_size is not None else {}
    host |= paged
    extras = {name: _host_ints(name, values) for name, values in (extra or {}).items()}
    dev = upload_packed(
        {**host, **{f"extra:{k}": v for k, v in extras.items()}}, torch.device(device)
    )

    out: dict[str, Any] = {"slot_mapping": dev["slot_mapping"], "block_table": dev["block_table"]}
    if is_cumulative(conv):
        # xLLM's CUDA layout: the lengths are the cumulative arrays; q_cu_seq_lens holds the ends
        out |= {
            "q_seq_lens": dev["q_cu"],
            "kv_seq_lens": dev["kv_cu"],
            "q_cu_seq_lens": dev["q_cu"][1:],
        }
        q_host, kv_host = q_cu, kv_cu
    else:
        q_cu_dev = dev["q_cu"][1:] if graph_mode else dev["q_cu"]
        out |= {"q_seq_lens": dev["q"], "kv_seq_lens": dev["kv"], "q_cu_seq_lens": q_cu_dev}
        q_host, kv_host = q, kv
    out |= {
        "kv_cu_seq_lens": dev["kv_cu"],
        "q_seq_lens_host": torch.from_numpy(q_host),
        "kv_seq_lens_host": torch.from_numpy(kv_host),
    }
    if paged:
        out |= {name: dev[name] for name in paged}
        out["paged_kv_indptr_host"] = torch.from_numpy(paged["paged_kv_indptr"])
        out["paged_kv_last_page_len_host"] = torch.from_numpy(paged["paged_kv_last_page_len"])
        out["qo_indptr"] = dev["q_cu"]
    out |= {
        "batch_forward_type": int(kind),
        "is_prefill": kind == BatchKind.PREFILL,
        "is_chunked_prefill": kind in (BatchKind.CHUNKED_PREFILL, BatchKind.MIXED),
        "max_query_len": int(q.max()) if q.size else 0,
        "max_seq_len": int(kv.max()) if kv.size else 0,
    }
    return out, {name: dev[f"extra:{name}"] for name in extras}


def _host_ints(name: str, values: IntsLike) -> np.ndarray:
    """A 1-D int32 numpy array of host values (a view when it already is one)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or values.dim() != 1:
            raise ValueError(f"{name} must be a 1-D CPU tensor or a list of ints (host values)")
        return values.to(torch.int32).numpy()
    array = np.asarray(values, dtype=np.int32)
    if array.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D list of ints (host values), got shape {array.shape}"
        )
    return array


def padded_table(
    rows: Sequence[Sequence[int]] | np.ndarray | torch.Tensor, num_seqs: int
) -> np.ndarray:
    """The block table as an int32 ``[B, width]`` array, rows padded with 0 as xLLM pads them."""
    if isinstance(rows, torch.Tensor | np.ndarray):
        if (isinstance(rows, torch.Tensor) and rows.device.type != "cpu") or rows.ndim != 2:
            raise ValueError("block_table must be a 2-D CPU tensor or a list of rows (host values)")
        table = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int32)
    elif len(rows) == 1:  # a lone sequence (batch 1): its row as it is, no padding to work out
        table = np.array(rows, dtype=np.int32).reshape(1, -1)
    else:
        row_lens = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        width = int(row_lens.max()) if row_lens.size else 0
        table = np.zeros((len(rows), width), dtype=np.int32)
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(row_lens.sum()))
        table[np.arange(width) < row_lens[:, None]] = flat  # row-major: row i's ids in order
    if table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table has {table.shape[0]} rows, expected one per sequence ({num_seqs})"
        )
    return table


def cumulative(per_seq: np.ndarray) -> np.ndarray:
    """Prefix sums with a leading 0, int32 ``[B + 1]``."""
    out = np.zeros(per_seq.size + 1, dtype=np.int32)
    np.cumsum(per_seq, out=out[1:])
    return out


def paged_kv(kv: np.ndarray, table: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """FlashInfer's paged-KV CSR arrays (indptr, indices, last page lengths) of the KV lengths."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    pages = (kv + block_size - 1) // block_size
    if kv.size and int(pages.max()) > table.shape[1]:
        i = int(pages.argmax())
        raise ValueError(
            f"block_table has {table.shape[1]} columns but a sequence of {int(kv[i])} tokens "
            f"needs {int(pages[i])} blocks of {block_size}"
        )
    return {
        "paged_kv_indptr": cumulative(pages),
        # row-major selection: each sequence's first ``pages`` ids, sequences in order
        "paged_kv_indices": table[np.arange(table.shape[1]) < pages[:, None]],
        # kv % block_size, or a full block (an empty sequence too: FlashInfer's convention)
        "paged_kv_last_page_len": (kv - (pages - 1) * block_size).astype(np.int32),
    }
