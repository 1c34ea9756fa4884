"""xLLM's attention-metadata view (either convention) -> xhal's normalized ``AttentionMetadata``."""

from __future__ import annotations

from typing import Any

import torch

from xhal.adapter.conventions import (
    Convention,
    cumulative,
    describe,
    is_cumulative,
    parse_convention,
    per_seq_host,
    seq_lens_numel,
)
from xhal.adapter.fields import (
    DEVICE_TENSORS,
    HOST_TENSORS,
    check_shape,
    check_tensor,
    host_values,
    read_view,
)
from xhal.adapter.kind import check_kind, resolve_kind
from xhal.adapter.shapes import PAGED_KV, check_shapes
from xhal.adapter.upload import upload
from xhal.interfaces.metadata import AttentionMetadata


def from_xllm(
    view: Any, convention: str, *, device: torch.device | str | None = None, check: bool = True
) -> AttentionMetadata:
    """Normalize xLLM's per-step metadata into ``AttentionMetadata`` without copying given tensors.

    ``view`` is an object with ``PyAttentionMetadataView`` attribute names or a dict of them;
    ``convention`` is ``"npu"`` or ``"cuda"`` (see ``xhal.adapter.conventions``). ``device`` is the
    compute device (default: ``slot_mapping``'s). Every given tensor that matches a normalized field
    is used as is (in ``"cuda"`` the cumulative ``q_seq_lens``/``kv_seq_lens`` ``[B+1]`` *are*
    ``q_cu_seq_lens``/``kv_cu_seq_lens``, and the per-sequence lengths are their differences,
    taken on the device); other absent fields are derived from host values and moved to the
    device in one copy. Device tensors are never read back to the host.

    Required: ``slot_mapping``, ``block_table`` (its rows give B) and, unless B == 0,
    ``kv_seq_lens_host`` or ``kv_seq_lens_host_values``. ``q_seq_lens_host`` may be left out when
    ``batch_forward_type`` or the two flags say DECODE or PREFILL. ``check=False`` skips the value
    checks on host lengths and ``AttentionMetadata.validate`` (shapes and dtypes are always
    checked): a served path that built the view itself passes it (``xhal.env.check_metadata``).

    Raises ``ValueError`` naming the field and what was expected for malformed input.
    """
    conv = parse_convention(convention)
    f = read_view(view)
    for name in ("slot_mapping", "block_table"):
        if f[name] is None:
            raise ValueError(
                f"metadata field {name} is required (int32 tensor on the compute device)"
            )
    dev = torch.device(device) if device is not None else f["slot_mapping"].device
    for name in DEVICE_TENSORS + HOST_TENSORS:
        if f[name] is not None:
            check_tensor(name, f[name], dev, host=name in HOST_TENSORS)
    if f["slot_mapping"].dim() != 1:
        raise ValueError(
            f"metadata field slot_mapping has shape {list(f['slot_mapping'].shape)}, expected [T]"
        )
    if f["block_table"].dim() != 2:
        raise ValueError(
            f"metadata field block_table has shape {list(f['block_table'].shape)}, "
            "expected [B, max_blocks]"
        )
    num_seqs = f["block_table"].shape[0]
    check_shapes(f, conv, num_seqs)

    kv_host = _host_lengths(f, "kv", conv, num_seqs, check)
    if kv_host is None:
        if num_seqs:
            raise ValueError(
                "metadata field kv_seq_lens_host (or kv_seq_lens_host_values) is required: lengths "
                "are derived from host values, device tensors are never read back"
            )
        kv_host = torch.zeros(0, dtype=torch.int32)
    q_host = _host_lengths(f, "q", conv, num_seqs, check)
    kind, q_host = resolve_kind(
        num_seqs, q_host, kv_host, f["batch_forward_type"], f["is_prefill"], f["is_chunked_prefill"]
    )
    if check:
        check_kind(kind, q_host, kv_host)

    cum = is_cumulative(conv)
    given = {
        "q_seq_lens": None if cum else f["q_seq_lens"],
        "kv_seq_lens": None if cum else f["kv_seq_lens"],
        "q_cu_seq_lens": _first(
            f["q_seq_lens"] if cum else None,
            f["q_cu_seq_lens"] if _numel(f["q_cu_seq_lens"]) == num_seqs + 1 else None,
            f["qo_indptr"],
        ),
        "kv_cu_seq_lens": _first(f["kv_cu_seq_lens"], f["kv_seq_lens"] if cum else None),
    }
    from_host = {
        "q_seq_lens": lambda: q_host,
        "kv_seq_lens": lambda: kv_host,
        "q_cu_seq_lens": lambda: cumulative(q_host),
        "kv_cu_seq_lens": lambda: cumulative(kv_host),
    }
    # Per-sequence lengths absent next to their given cumulative device twin (the CUDA layout)
    # are differenced on the device: one small op each, no sync, and no second upload of values
    # the step's one copy already carried. Whatever else is absent is built from host values and
    # moved in one copy.
    for per_seq, cu in (("q_seq_lens", "q_cu_seq_lens"), ("kv_seq_lens", "kv_cu_seq_lens")):
        if given[per_seq] is None and given[cu] is not None:
            given[per_seq] = given[cu][1:] - given[cu][:-1]  # [B]
    derived = upload({k: from_host[k]() for k, t in given.items() if t is None}, dev)
    lens = {k: t if t is not None else derived[k] for k, t in given.items()}

    max_q, max_kv = f["max_query_len"], f["max_seq_len"]
    metadata = AttentionMetadata(
        kind=kind,
        num_seqs=num_seqs,
        num_tokens=f["slot_mapping"].shape[0],
        max_query_len=int(max_q) if max_q is not None else int(q_host.max()) if num_seqs else 0,
        max_seq_len=int(max_kv) if max_kv is not None else int(kv_host.max()) if num_seqs else 0,
        q_seq_lens_host=q_host,
        kv_seq_lens_host=kv_host,
        block_table=f["block_table"],
        slot_mapping=f["slot_mapping"],
        **lens,
        **{name: f[name] for name in PAGED_KV},
        paged_kv_indptr_host=f["paged_kv_indptr_host"],
        paged_kv_last_page_len_host=f["paged_kv_last_page_len_host"],
    )
    if check:
        metadata.validate()
    return metadata


def _host_lengths(
    f: dict[str, Any], prefix: str, conv: Convention, num_seqs: int, check: bool
) -> torch.Tensor | None:
    """Per-sequence host lengths ``[B]`` for ``q`` or ``kv``, or ``None`` when none were given."""
    name = f"{prefix}_seq_lens_host"
    host = f[name]
    if prefix == "kv" and f["kv_seq_lens_host_values"] is not None:
        values = host_values("kv_seq_lens_host_values", f["kv_seq_lens_host_values"])
        n = seq_lens_numel(conv, num_seqs)
        check_shape("kv_seq_lens_host_values", values, ((n,),), describe(conv, num_seqs))
        if host is None:
            host = values
        elif check and not torch.equal(host, values):
            raise ValueError(
                f"metadata field kv_seq_lens_host_values {values.tolist()} disagrees with "
                f"kv_seq_lens_host {host.tolist()}; they must hold the same values"
            )
    return None if host is None else per_seq_host(name, host, conv, check=check)


def _numel(t: torch.Tensor | None) -> int:
    return -1 if t is None else t.numel()


def _first(*candidates: torch.Tensor | None) -> torch.Tensor | None:
    return next((t for t in candidates if t is not None), None)
