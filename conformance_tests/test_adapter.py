"""The "adapter" family: xLLM's metadata layouts (npu and cuda conventions) -> AttentionMetadata.

Expected values are written out by hand; errors are exact (recorded as 0.0).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from xhal.adapter import from_xllm, to_xllm
from xhal.interfaces.metadata import AttentionMetadata, BatchKind

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


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_normalized_fields(convention, device, record_error):
    md = from_xllm(xllm_view(convention, device), convention)
    got = (md.kind, md.num_seqs, md.num_tokens, md.max_query_len, md.max_seq_len)
    assert got == (BatchKind.MIXED, 3, 10, 4, 7)
    assert_normalized(md, device, record_error)
    assert md.paged_kv_indptr is None and md.device.type == device.type


# normalized field -> the given field it must be a view of
VIEWS = {
    "npu": {
        name: name
        for name in ("q_seq_lens", "kv_seq_lens", "q_cu_seq_lens", "kv_cu_seq_lens", *HOST_FIELDS)
    },
    "cuda": {"q_cu_seq_lens": "q_seq_lens", "kv_cu_seq_lens": "kv_cu_seq_lens"},
}


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_given_tensors_are_not_copied(convention, device, record_error):
    view = xllm_view(convention, device, **{k: i32(v, device) for k, v in PAGED.items()})
    md = from_xllm(view, convention)
    shared = {**VIEWS[convention], "block_table": "block_table", "slot_mapping": "slot_mapping"}
    shared |= {name: name for name in PAGED}
    for out_name, in_name in shared.items():
        out, given = getattr(md, out_name), view[in_name]
        assert out.data_ptr() == given.data_ptr() and out.shape == given.shape, (
            f"{out_name} was copied"
        )
    for name, expected in PAGED.items():
        assert_exact(getattr(md, name), expected, record_error)


def test_cuda_cumulative_kv_seq_lens_is_kv_cu_seq_lens(device, record_error):
    view = xllm_view("cuda", device, kv_cu_seq_lens=None)
    md = from_xllm(view, "cuda")
    assert md.kv_cu_seq_lens.data_ptr() == view["kv_seq_lens"].data_ptr()
    assert_normalized(md, device, record_error)


@pytest.mark.parametrize("leading_zero", [True, False], ids=["B+1", "B-graph-mode"])
def test_npu_q_cu_seq_lens_forms(leading_zero, device, record_error):
    q_cu = i32([0, 1, 4, 8] if leading_zero else [1, 4, 8], device)
    view = xllm_view("npu", device, q_cu_seq_lens=q_cu)
    md = from_xllm(view, "npu")
    assert_normalized(md, device, record_error)
    assert (md.q_cu_seq_lens.data_ptr() == q_cu.data_ptr()) == leading_zero


@pytest.mark.parametrize("q_cu", [[1, 4, 8], [0, 1, 4, 8]], ids=["ends-B", "B+1"])
def test_cuda_q_cu_seq_lens_forms(q_cu, device, record_error):
    given = i32(q_cu, device)
    view = xllm_view("cuda", device, q_seq_lens=None, q_cu_seq_lens=given)
    md = from_xllm(view, "cuda")
    assert_normalized(md, device, record_error)
    assert (md.q_cu_seq_lens.data_ptr() == given.data_ptr()) == (len(q_cu) == 4)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_qo_indptr_serves_as_q_cu_seq_lens(convention, device, record_error):
    qo = i32([0, 1, 4, 8], device)
    view = xllm_view(convention, device, q_seq_lens=None, q_cu_seq_lens=None, qo_indptr=qo)
    md = from_xllm(view, convention)
    assert md.q_cu_seq_lens.data_ptr() == qo.data_ptr()
    assert_normalized(md, device, record_error)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_derives_absent_fields_from_host_values(convention, device, record_error):
    view = lengths_view(
        convention, device, Q, KV, slot_mapping=i32(SLOTS, device), block_table=i32(BLOCKS, device)
    )
    md = from_xllm(view, convention)
    assert md.kind == BatchKind.MIXED
    assert_normalized(md, device, record_error)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_device_tensors_are_never_read(convention, record_error):
    # meta tensors have no data: any read of a device value (a sync) would raise
    view = xllm_view(convention, "meta")
    md = from_xllm(view, convention)
    assert md.kind == BatchKind.MIXED and md.device.type == "meta"
    assert md.q_seq_lens.shape == (3,) and md.kv_cu_seq_lens.shape == (4,)
    md = from_xllm(lengths_view(convention, "meta", Q, KV), convention)
    assert md.q_cu_seq_lens.device.type == "meta" and md.q_cu_seq_lens.shape == (4,)
    assert_exact(md.q_seq_lens_host, Q, record_error)


KIND_CASES = [
    # (q_lens, kv_lens, extra view fields, expected kind)
    ([], [], {}, BatchKind.EMPTY),
    ([1, 1], [5, 9], {}, BatchKind.DECODE),
    ([1, 1], [1, 1], {}, BatchKind.DECODE),
    ([1, 1], [1, 1], {"is_prefill": True}, BatchKind.PREFILL),
    ([3, 4], [3, 4], {}, BatchKind.PREFILL),
    ([1, 3], [5, 7], {}, BatchKind.MIXED),
    ([1, 4], [5, 4], {}, BatchKind.MIXED),
    ([2, 3], [5, 7], {}, BatchKind.CHUNKED_PREFILL),
    ([3, 4], [3, 9], {}, BatchKind.CHUNKED_PREFILL),
    ([1, 1], [5, 9], {"is_chunked_prefill": True}, BatchKind.CHUNKED_PREFILL),
    ([2, 3], [5, 7], {"batch_forward_type": BatchKind.MIXED}, BatchKind.MIXED),
    ([3, 4], [3, 4], {"batch_forward_type": 1}, BatchKind.CHUNKED_PREFILL),
    ([1, 1], [5, 9], {"batch_forward_type": "decode"}, BatchKind.DECODE),
]


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("q, kv, extra, kind", KIND_CASES)
def test_kind_derivation(convention, q, kv, extra, kind, device):
    md = from_xllm(lengths_view(convention, device, q, kv, **extra), convention)
    assert md.kind == kind
    assert md.num_seqs == len(q)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize(
    "q, kv, flags, kind",
    [
        ([1, 1], [5, 9], {"is_prefill": False, "is_chunked_prefill": False}, BatchKind.DECODE),
        ([3, 4], [3, 4], {"is_prefill": True, "is_chunked_prefill": False}, BatchKind.PREFILL),
        ([1, 1], [5, 9], {"batch_forward_type": 2}, BatchKind.DECODE),
    ],
)
def test_q_seq_lens_host_inferred_when_stated(convention, q, kv, flags, kind, device, record_error):
    # xLLM's view has no q_seq_lens_host; DECODE and PREFILL state the query lengths
    md = from_xllm(
        lengths_view(convention, device, q, kv, q_seq_lens_host=None, **flags), convention
    )
    assert md.kind == kind
    assert_exact(md.q_seq_lens_host, q, record_error)
    assert_exact(md.q_cu_seq_lens, cum(q), record_error)


def _swap(convention: str) -> str:
    return "cuda" if convention == "npu" else "npu"


# (id, view builder (convention, device) -> view, kwargs for from_xllm, error pattern)
MALFORMED = [
    (
        "missing-slot_mapping",
        lambda c, d: xllm_view(c, d, slot_mapping=None),
        "slot_mapping is required",
    ),
    (
        "missing-block_table",
        lambda c, d: xllm_view(c, d, block_table=None),
        "block_table is required",
    ),
    (
        "missing-kv-host",
        lambda c, d: xllm_view(c, d, kv_seq_lens_host=None, kv_seq_lens_host_values=None),
        "kv_seq_lens_host",
    ),
    (
        "missing-q-host-chunked",
        lambda c, d: xllm_view(c, d, q_seq_lens_host=None),
        "q_seq_lens_host is required",
    ),
    (
        "missing-q-host-no-flags",
        lambda c, d: xllm_view(
            c, d, q_seq_lens_host=None, is_prefill=None, is_chunked_prefill=None
        ),
        "q_seq_lens_host is missing",
    ),
    (
        "q_seq_lens-other-convention",
        lambda c, d: xllm_view(
            c, d, q_seq_lens=i32(LAYOUT[_swap(c)]["q_seq_lens"], d), q_seq_lens_host=None
        ),
        r"q_seq_lens has shape .* expected",
    ),
    (
        "kv_seq_lens-other-convention",
        lambda c, d: xllm_view(
            c, d, kv_seq_lens=i32(LAYOUT[_swap(c)]["kv_seq_lens"], d), kv_seq_lens_host=None
        ),
        r"kv_seq_lens has shape .* expected",
    ),
    (
        "host-device-shape-disagree",
        lambda c, d: xllm_view(c, d, q_seq_lens_host=i32(LAYOUT[_swap(c)]["q_seq_lens"], "cpu")),
        "q_seq_lens_host .* device twin q_seq_lens",
    ),
    (
        "kv-host-values-length",
        lambda c, d: xllm_view(c, d, kv_seq_lens_host_values=[5, 7, 4, 1, 1]),
        "kv_seq_lens_host_values has shape",
    ),
    (
        "kv-host-values-disagree",
        lambda c, d: xllm_view(
            c, d, kv_seq_lens_host_values=[v + 1 for v in LAYOUT[c]["kv_seq_lens"]]
        ),
        "kv_seq_lens_host_values .* disagrees",
    ),
    (
        "q_cu_seq_lens-length",
        lambda c, d: xllm_view(c, d, q_cu_seq_lens=i32([0, 1, 4, 8, 8], d)),
        "q_cu_seq_lens",
    ),
    (
        "kv_cu_seq_lens-length",
        lambda c, d: xllm_view(c, d, kv_cu_seq_lens=i32([5, 12, 16], d)),
        "kv_cu_seq_lens",
    ),
    (
        "slot_mapping-int64",
        lambda c, d: xllm_view(c, d, slot_mapping=torch.tensor(SLOTS, device=d)),
        "slot_mapping has dtype torch.int64, expected torch.int32",
    ),
    (
        "block_table-int64",
        lambda c, d: xllm_view(c, d, block_table=torch.tensor(BLOCKS, device=d)),
        "block_table has dtype",
    ),
    (
        "host-int64",
        lambda c, d: xllm_view(c, d, kv_seq_lens_host=torch.tensor(LAYOUT[c]["kv_seq_lens"])),
        "kv_seq_lens_host has dtype",
    ),
    (
        "block_table-1d",
        lambda c, d: xllm_view(c, d, block_table=i32([7, 2, 3], d)),
        r"block_table has shape \[3\], expected \[B, max_blocks\]",
    ),
    (
        "host-tensor-on-device",
        lambda c, d: xllm_view(c, d, q_seq_lens_host=i32(LAYOUT[c]["q_seq_lens"], "meta")),
        "q_seq_lens_host is on meta, expected a CPU",
    ),
    (
        "device-tensor-elsewhere",
        lambda c, d: xllm_view(c, d, kv_seq_lens=i32(LAYOUT[c]["kv_seq_lens"], "meta")),
        "kv_seq_lens is on meta, expected .* compute device",
    ),
    (
        "paged-kv-partial",
        lambda c, d: xllm_view(c, d, paged_kv_indptr=i32(PAGED["paged_kv_indptr"], d)),
        "paged_kv_indptr.* come together",
    ),
    (
        "batch_forward_type-unknown",
        lambda c, d: xllm_view(c, d, batch_forward_type=9),
        "batch_forward_type is 9",
    ),
    (
        "batch_forward_type-contradicted",
        lambda c, d: xllm_view(c, d, batch_forward_type=BatchKind.DECODE),
        "batch_forward_type is DECODE",
    ),
    (
        "unknown-field",
        lambda c, d: {**xllm_view(c, d), "slot_maping": None},
        "unknown metadata field",
    ),
    (
        "q-longer-than-kv",
        lambda c, d: xllm_view(
            c, d, q_seq_lens_host=i32(cum([1, 3, 5]) if c == "cuda" else [1, 3, 5], "cpu")
        ),
        "q_seq_len > kv_seq_len",
    ),
    (
        "bad-host-lengths",
        lambda c, d: xllm_view(
            c,
            d,
            kv_seq_lens_host=i32([1, 5, 12, 16] if c == "cuda" else [5, -7, 4], "cpu"),
            kv_seq_lens_host_values=None,
        ),
        "kv_seq_lens_host (must start with 0|has a negative length)",
    ),
]


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("build, match", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_input_raises(convention, build, match, device):
    with pytest.raises(ValueError, match=match):
        from_xllm(build(convention, device), convention)


def test_unknown_convention_raises(device):
    with pytest.raises(ValueError, match="unknown convention 'rocm'"):
        from_xllm(xllm_view("npu", device), "rocm")


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_to_xllm_emits_the_xllm_layout(convention, device, record_error):
    out = to_xllm(Q, KV, BLOCK_ROWS, SLOTS, convention, device, block_size=4)
    lay = LAYOUT[convention]
    expected = {**lay, "q_seq_lens_host": lay["q_seq_lens"], "kv_seq_lens_host": lay["kv_seq_lens"]}
    expected |= {
        "kv_cu_seq_lens": [0, 5, 12, 16],
        "block_table": BLOCKS,
        "slot_mapping": SLOTS,
        **PAGED,
    }
    expected["qo_indptr"] = [0, 1, 4, 8]
    for name, values in expected.items():
        assert_exact(out[name], values, record_error)
        want = "cpu" if name in HOST_FIELDS else device.type
        assert out[name].device.type == want, name
    assert out["kv_seq_lens_host_values"] == lay["kv_seq_lens"]
    assert (out["batch_forward_type"], out["is_prefill"], out["is_chunked_prefill"]) == (
        3,
        False,
        True,
    )


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("block_size", [None, 4])
def test_round_trip(convention, block_size, device, record_error):
    out = to_xllm(Q, KV, BLOCK_ROWS, SLOTS, convention, device, block_size=block_size)
    md = from_xllm(out, convention)
    assert md.kind == BatchKind.MIXED
    assert_normalized(md, device, record_error)
    for name in ("slot_mapping", "block_table", *(PAGED if block_size else ())):
        assert getattr(md, name).data_ptr() == out[name].data_ptr(), f"{name} was copied"
    if block_size:
        for name, values in PAGED.items():
            assert_exact(getattr(md, name), values, record_error)


def test_round_trip_npu_graph_mode(device, record_error):
    out = to_xllm(Q, KV, BLOCK_ROWS, SLOTS, "npu", device, graph_mode=True)
    assert_exact(out["q_cu_seq_lens"], [1, 4, 8], record_error)
    assert_normalized(from_xllm(out, "npu"), device, record_error)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize(
    "q, kv, kind",
    [
        ([], [], BatchKind.EMPTY),
        ([1, 1], [6, 2], BatchKind.DECODE),
        ([2, 5], [2, 5], BatchKind.PREFILL),
        ([2, 5], [4, 5], BatchKind.CHUNKED_PREFILL),
    ],
)
def test_round_trip_kinds(convention, q, kv, kind, device, record_error):
    rows = [[i] * -(-n // 4) for i, n in enumerate(kv)]
    md = from_xllm(to_xllm(q, kv, rows, [0] * sum(q), convention, device, block_size=4), convention)
    assert (md.kind, md.num_seqs, md.num_tokens) == (kind, len(q), sum(q))
    assert_exact(md.q_cu_seq_lens, cum(q), record_error)
    assert_exact(md.kv_seq_lens, kv, record_error)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([1, 2], [5], [[0], [1]], [0, 0, 0], "npu"), {}, "sequences"),
        (([3], [2], [[0]], [0, 0, 0], "npu"), {}, "q_seq_lens <= kv_seq_lens"),
        (([1], [9], [[0, 1]], [0], "npu"), {"block_size": 4}, "needs 3 blocks"),
        (([1], [5], [[0, 1]], [0], "cuda"), {"graph_mode": True}, "graph_mode"),
        (([1], [5], [[0, 1], [2]], [0], "npu"), {}, "block_table has 2 rows"),
    ],
)
def test_to_xllm_rejects_bad_input(args, kwargs, match, device):
    with pytest.raises(ValueError, match=match):
        to_xllm(*args[:4], args[4], device, **kwargs)
