"""Per-sequence host lengths -> xLLM's metadata layout in either convention, as C++ emits it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xhal.adapter.conventions import cumulative, is_cumulative, parse_convention
from xhal.adapter.kind import derive_kind
from xhal.adapter.upload import upload
from xhal.interfaces.metadata import BatchKind

IntsLike = Sequence[int] | torch.Tensor


def to_xllm(
    q_seq_lens: IntsLike,
    kv_seq_lens: IntsLike,
    block_table: Sequence[Sequence[int]] | torch.Tensor,
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
    With ``block_size``, ``paged_kv_indptr``/``paged_kv_indices``/``paged_kv_last_page_len`` and
    ``qo_indptr`` are added as xLLM's CUDA builder adds them (last page length is
    ``kv_len % block_size`` or ``block_size``). ``kind`` defaults to ``derive_kind`` of the lengths.
    Device tensors reach ``device`` in one copy; feed the result to ``from_xllm``.
    """
    conv = parse_convention(convention)
    q, kv = _host_ints("q_seq_lens", q_seq_lens), _host_ints("kv_seq_lens", kv_seq_lens)
    if q.numel() != kv.numel():
        raise ValueError(f"q_seq_lens has {q.numel()} sequences but kv_seq_lens has {kv.numel()}")
    if bool((q < 0).any()) or bool((q > kv).any()):
        raise ValueError(
            f"expected 0 <= q_seq_lens <= kv_seq_lens, got {q.tolist()} and {kv.tolist()}"
        )
    if graph_mode and conv != "npu":
        raise ValueError(
            "graph_mode (q_cu_seq_lens without leading 0) exists only in convention 'npu'"
        )
    table = _padded_table(block_table, q.numel())
    slots = _host_ints("slot_mapping", slot_mapping)
    kind = derive_kind(q, kv) if kind is None else BatchKind(kind)
    q_cu, kv_cu = cumulative(q), cumulative(kv)

    host = {"slot_mapping": slots, "block_table": table, "q_cu": q_cu, "kv_cu": kv_cu}
    if not is_cumulative(conv):
        host |= {"q": q, "kv": kv}
    if block_size is not None:
        host |= _paged_kv(kv, table, block_size)
    dev = upload(host, torch.device(device))

    out: dict[str, Any] = {"slot_mapping": dev["slot_mapping"], "block_table": dev["block_table"]}
    if is_cumulative(conv):
        # xLLM's CUDA layout: the lengths are the cumulative arrays; q_cu_seq_lens holds the ends
        out |= {
            "q_seq_lens": dev["q_cu"],
            "kv_seq_lens": dev["kv_cu"],
            "q_cu_seq_lens": dev["q_cu"][1:],
        }
        out |= {"kv_cu_seq_lens": dev["kv_cu"], "q_seq_lens_host": q_cu, "kv_seq_lens_host": kv_cu}
    else:
        q_cu_dev = dev["q_cu"][1:] if graph_mode else dev["q_cu"]
        out |= {"q_seq_lens": dev["q"], "kv_seq_lens": dev["kv"], "q_cu_seq_lens": q_cu_dev}
        out |= {"kv_cu_seq_lens": dev["kv_cu"], "q_seq_lens_host": q, "kv_seq_lens_host": kv}
    out["kv_seq_lens_host_values"] = out["kv_seq_lens_host"].tolist()
    if block_size is not None:
        out |= {
            name: dev[name]
            for name in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
        }
        out["qo_indptr"] = dev["q_cu"]
    out |= {
        "batch_forward_type": int(kind),
        "is_prefill": kind == BatchKind.PREFILL,
        "is_chunked_prefill": kind in (BatchKind.CHUNKED_PREFILL, BatchKind.MIXED),
        "max_query_len": int(q.max()) if q.numel() else 0,
        "max_seq_len": int(kv.max()) if kv.numel() else 0,
    }
    return out


def _host_ints(name: str, values: IntsLike) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or values.dim() != 1:
            raise ValueError(f"{name} must be a 1-D CPU tensor or a list of ints (host values)")
        return values.to(torch.int32)
    return torch.tensor(list(values), dtype=torch.int32).reshape(-1)


def _padded_table(rows: Sequence[Sequence[int]] | torch.Tensor, num_seqs: int) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        if rows.device.type != "cpu" or rows.dim() != 2:
            raise ValueError("block_table must be a 2-D CPU tensor or a list of rows (host values)")
        table = rows.to(torch.int32)
    else:
        width = max((len(r) for r in rows), default=0)
        table = torch.zeros(len(rows), width, dtype=torch.int32)  # xLLM pads rows with 0
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(list(r), dtype=torch.int32)
    if table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table has {table.shape[0]} rows, expected one per sequence ({num_seqs})"
        )
    return table


def _paged_kv(kv: torch.Tensor, table: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    pages = (kv + block_size - 1) // block_size
    if kv.numel() and int(pages.max()) > table.shape[1]:
        raise ValueError(
            f"block_table has {table.shape[1]} columns but a sequence of {int(kv.max())} tokens "
            f"needs {int(pages.max())} blocks of {block_size}"
        )
    indices = [table[i, :n] for i, n in enumerate(pages.tolist())]
    last = kv % block_size
    return {
        "paged_kv_indptr": cumulative(pages),
        "paged_kv_indices": torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int32),
        "paged_kv_last_page_len": torch.where(last == 0, block_size, last).to(torch.int32),
    }
