"""The "adapter" family, xLLM -> xhal: ``from_xllm`` reads xLLM's metadata layouts (npu and cuda
conventions) into ``AttentionMetadata``: the normalized fields, zero-copy views of the given
tensors, fields derived from host values, the batch kind, and refusal of malformed input.

Expected values are written out by hand; errors are exact (recorded as 0.0).
"""

from __future__ import annotations

import pytest
import torch

from conformance_tests.adapter_cases import (
    BLOCKS,
    CONVENTIONS,
    HOST_FIELDS,
    KV,
    LAYOUT,
    PAGED,
    SLOTS,
    Q,
    assert_exact,
    assert_normalized,
    cum,
    i32,
    lengths_view,
    xllm_view,
)
from xhal.adapter.from_xllm import from_xllm
from xhal.interfaces.metadata import BatchKind


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
