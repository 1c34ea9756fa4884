"""The "adapter" family, xhal -> xLLM: ``to_xllm`` lays a batch out as xLLM's builder does in each
convention (npu and cuda), refuses inconsistent input, and round-trips through ``from_xllm``
without copying the tensors it made.

Expected values are written out by hand; errors are exact (recorded as 0.0).
"""

from __future__ import annotations

import pytest

from conformance_tests.adapter_cases import (
    BLOCK_ROWS,
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
)
from xhal.adapter.from_xllm import from_xllm
from xhal.adapter.to_xllm import to_xllm
from xhal.interfaces.metadata import BatchKind


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
        # FlashInfer's host plan reads these: carried through as the host built them
        for name in ("paged_kv_indptr_host", "paged_kv_last_page_len_host"):
            host = getattr(md, name)
            assert host.device.type == "cpu" and host.data_ptr() == out[name].data_ptr(), name
            assert_exact(host, PAGED[name[: -len("_host")]], record_error)


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
