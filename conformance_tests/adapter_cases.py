"""The adapter family's shared cases: one batch written out by hand, its layout in each of xLLM's
conventions (npu and cuda), builders of xLLM views of it, and exact int32 comparisons."""

from __future__ import annotations

from collections.abc import Callable

import torch

from xhal.interfaces.metadata import AttentionMetadata

CONVENTIONS = ("npu", "cuda")

# One batch, block_size 4: seq 0 decodes 1 token over 4 cached, seq 1 adds a 3-token chunk over 4
# cached, seq 2 is a fresh 4-token prompt; 2 padding tokens (slot -1) end the step.
Q, KV = [1, 3, 4], [5, 7, 4]
BLOCK_ROWS = [[7, 2], [3, 9], [5]]
BLOCKS = [[7, 2], [3, 9], [5, 0]]  # padded with 0
SLOTS = [2 * 4 + 0, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2, 20, 21, 22, 23, -1, -1]
NORMALIZED = {
    "q_cu_seq_lens": [0, 1, 4, 8],
    "kv_cu_seq_lens": [0, 5, 12, 16],
    "q_seq_lens": Q,
    "kv_seq_lens": KV,
    "q_seq_lens_host": Q,
    "kv_seq_lens_host": KV,
    "block_table": BLOCKS,
    "slot_mapping": SLOTS,
}
# The same batch as xLLM's builder lays it out per platform.
LAYOUT = {
    "npu": {"q_seq_lens": Q, "kv_seq_lens": KV, "q_cu_seq_lens": [0, 1, 4, 8]},
    "cuda": {"q_seq_lens": [0, 1, 4, 8], "kv_seq_lens": [0, 5, 12, 16], "q_cu_seq_lens": [1, 4, 8]},
}
PAGED = {
    "paged_kv_indptr": [0, 2, 4, 5],
    "paged_kv_indices": [7, 2, 3, 9, 5],
    "paged_kv_last_page_len": [1, 3, 4],
}
HOST_FIELDS = ("q_seq_lens_host", "kv_seq_lens_host")


def i32(values: list, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def cum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def xllm_view(convention: str, device: torch.device | str, **overrides: object) -> dict:
    """The batch above in xLLM's layout; an override of ``None`` leaves a field out."""
    lay = LAYOUT[convention]
    view = {
        "slot_mapping": i32(SLOTS, device),
        "block_table": i32(BLOCKS, device),
        "q_seq_lens": i32(lay["q_seq_lens"], device),
        "kv_seq_lens": i32(lay["kv_seq_lens"], device),
        "q_cu_seq_lens": i32(lay["q_cu_seq_lens"], device),
        "kv_cu_seq_lens": i32([0, 5, 12, 16], device),
        "q_seq_lens_host": i32(lay["q_seq_lens"], "cpu"),
        "kv_seq_lens_host": i32(lay["kv_seq_lens"], "cpu"),
        "kv_seq_lens_host_values": list(lay["kv_seq_lens"]),
        "is_prefill": False,
        "is_chunked_prefill": True,
    }
    view.update(overrides)
    return {k: v for k, v in view.items() if v is not None}


def lengths_view(
    convention: str, device: torch.device | str, q: list[int], kv: list[int], **extra: object
) -> dict:
    """Only what is required, plus host lengths, for per-sequence ``q``/``kv`` in ``convention``."""
    host = cum if convention == "cuda" else list
    view = {
        "slot_mapping": i32([0] * sum(q), device),
        "block_table": torch.zeros(len(q), 4, dtype=torch.int32, device=device),
        "q_seq_lens_host": i32(host(q), "cpu"),
        "kv_seq_lens_host_values": host(kv),
    }
    view.update(extra)
    return {k: v for k, v in view.items() if v is not None}


def assert_exact(
    actual: torch.Tensor, expected: list, record_error: Callable[[float], None]
) -> None:
    want = torch.tensor(expected, dtype=torch.int32)
    assert actual.dtype == torch.int32
    assert tuple(actual.shape) == tuple(want.shape), (tuple(actual.shape), tuple(want.shape))
    err = float((actual.cpu().long() - want.long()).abs().max()) if want.numel() else 0.0
    record_error(err)
    assert err == 0.0, f"{actual.tolist()} != {expected}"


def assert_normalized(md: AttentionMetadata, device: torch.device, record_error) -> None:
    for name, expected in NORMALIZED.items():
        t = getattr(md, name)
        assert_exact(t, expected, record_error)
        want = "cpu" if name in HOST_FIELDS else device.type
        assert t.device.type == want, f"{name} is on {t.device}, expected {want}"
    md.validate()
