"""Shape rules of the xLLM view's tensors, per convention, checked before any value is used."""

from __future__ import annotations

from typing import Any

from xhal.adapter.conventions import Convention, describe, seq_lens_numel
from xhal.adapter.fields import check_shape

PAGED_KV = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")

_Q_CU_RULE = {
    "npu": "convention 'npu': inclusive cumsum [B] without leading 0 (graph mode) or [B+1] with it",
    "cuda": "convention 'cuda': sequence ends [B], or [B+1] with a leading 0",
}


def check_shapes(f: dict[str, Any], convention: Convention, num_seqs: int) -> None:
    """Raise ``ValueError`` naming the first field whose shape breaks the convention's rules.

    ``f`` holds the view's fields (``None`` when absent); B = ``num_seqs`` comes from block_table.
    """
    b = num_seqs
    n = seq_lens_numel(convention, b)
    for dev_name in ("q_seq_lens", "kv_seq_lens"):
        host_name = f"{dev_name}_host"
        d, h = f[dev_name], f[host_name]
        # a twin mismatch is reported as such: it says which side to fix better than "expected [n]"
        if d is not None and h is not None and d.shape != h.shape:
            raise ValueError(
                f"metadata field {host_name} has shape {list(h.shape)} but its device twin "
                f"{dev_name} has {list(d.shape)}: host tensors follow their device twins' layout"
            )
        for name in (dev_name, host_name):
            if f[name] is not None:
                check_shape(name, f[name], ((n,),), lambda: describe(convention, b))
    if f["q_cu_seq_lens"] is not None:
        check_shape(
            "q_cu_seq_lens",
            f["q_cu_seq_lens"],
            ((b,), (b + 1,)),
            lambda: f"{_Q_CU_RULE[convention]}, B={b}",
        )
    for name in ("kv_cu_seq_lens", "qo_indptr", "paged_kv_indptr"):
        if f[name] is not None:
            check_shape(name, f[name], ((b + 1,),), lambda: f"leading 0, [B+1], B={b}")

    given_paged = [name for name in PAGED_KV if f[name] is not None]
    if given_paged and len(given_paged) != len(PAGED_KV):
        raise ValueError(
            f"metadata fields {list(PAGED_KV)} come together; got only {given_paged} "
            "(give all three, as xLLM's CUDA builder does, or none)"
        )
    for name in ("paged_kv_indptr_host", "paged_kv_last_page_len_host"):
        if f[name] is not None:
            if not given_paged:
                raise ValueError(
                    f"metadata field {name} is the host twin of {name[: -len('_host')]}: "
                    f"give it with the device fields {list(PAGED_KV)}, or leave it out"
                )
            twin = f[name[: -len("_host")]]
            check_shape(name, f[name], (tuple(twin.shape),), "the shape of its device twin")
    if given_paged:
        check_shape("paged_kv_last_page_len", f["paged_kv_last_page_len"], ((b,),), f"[B], B={b}")
        indices = f["paged_kv_indices"]
        if indices.dim() != 1:
            raise ValueError(
                f"metadata field paged_kv_indices has shape {list(indices.shape)}, "
                "expected [nnz_pages]"
            )
