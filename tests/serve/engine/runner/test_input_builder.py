"""The reference host's input builder: each step is laid out once and every device tensor of it
reaches the device in ONE host-to-device copy, with the paged-KV host arrays carried through.

The "device" here is PyTorch's ``meta`` device: copies to it are real dispatcher calls that a
``TorchDispatchMode`` can count, on any machine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from serve_cli.engine.batch import PLACEHOLDER_TOKEN_ID
from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.request import Request
from serve_cli.engine.runner.input_builder import HostStep, InputBuilder, PreviousTokens
from serve_cli.engine.scheduler import Scheduler


class HostToDevice(TorchDispatchMode):
    """Counts the ops that take a CPU tensor and return a tensor on another device."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        if (
            isinstance(out, torch.Tensor)
            and out.device.type != "cpu"
            and any(a.device.type == "cpu" for a in ins)
        ):
            self.copies.append(str(func))
        return out


def _mixed_batch():
    """A decode next to a prompt chunk, as the scheduler builds them."""
    bm = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64)
    scheduler.submit(Request("a", [5, 6, 7], max_tokens=4))
    scheduler.advance(scheduler.next_batch(), {"a": 9})
    scheduler.submit(Request("b", list(range(1, 11)), max_tokens=4))
    return scheduler.next_batch()


@pytest.mark.parametrize("convention", ["cuda", "npu"])
def test_a_step_reaches_the_device_in_one_copy(convention: str) -> None:
    batch = _mixed_batch()
    builder = InputBuilder(torch.device("meta"), convention, block_size=4)
    step = builder.describe(batch)
    with HostToDevice() as counter:
        inputs = builder.upload(step)
    assert len(counter.copies) == 1, counter.copies
    md = inputs.metadata
    device_fields = [
        f.name for f in dataclasses.fields(md) if isinstance(getattr(md, f.name), torch.Tensor)
    ]
    for name in device_fields:
        want = "cpu" if name.endswith("_host") else "meta"
        assert getattr(md, name).device.type == want, name
    for t in (inputs.input_ids, inputs.positions, inputs.selected_idxes):
        assert t.device.type == "meta"
    assert (md.paged_kv_indptr is not None) == (convention == "cuda")


def test_the_host_csr_arrays_match_the_block_table() -> None:
    """xLLM's CUDA layout carries FlashInfer's host arrays: page counts per sequence and the
    tokens in each last page, computed here by hand from the batch."""
    batch = _mixed_batch()
    md = InputBuilder(torch.device("cpu"), "cuda", block_size=4).build(batch)
    a, b = batch.requests  # a: a decode at kv length 4; b: a 10-token prompt chunk
    assert (a.end_position, b.end_position) == (4, 10)
    assert md.metadata.paged_kv_indptr_host.tolist() == [0, 1, 4]
    assert md.metadata.paged_kv_last_page_len_host.tolist() == [4, 2]
    assert md.metadata.paged_kv_indices.tolist() == a.block_table[:1] + b.block_table[:3]


def test_metadata_checks_run_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The served path skips the adapter's value checks (its layout is right by construction);
    XHAL_CHECK_METADATA=1 turns them back on, and the step they check is the same."""
    batch = _mixed_batch()
    monkeypatch.delenv("XHAL_CHECK_METADATA", raising=False)
    fast = InputBuilder(torch.device("cpu"), "cuda", block_size=4)
    monkeypatch.setenv("XHAL_CHECK_METADATA", "1")
    checked = InputBuilder(torch.device("cpu"), "cuda", block_size=4)
    assert (fast.check, checked.check) == (False, True)
    a, b = fast.build(batch).metadata, checked.build(batch).metadata
    for name in (
        "q_cu_seq_lens",
        "kv_cu_seq_lens",
        "q_seq_lens",
        "kv_seq_lens",
        "block_table",
        "slot_mapping",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.kind == b.kind and a.kv_seq_lens.tolist() == [4, 10]


def test_the_host_step_is_the_batch_laid_out_by_hand() -> None:
    """``describe`` against the layout written out here: a's decode token (position 3 of a
    4-token context) then b's ten prompt tokens, each at its block's slot, sampling the last
    token of each."""
    batch = _mixed_batch()
    a, b = batch.requests
    step = InputBuilder(torch.device("cpu"), "cuda", block_size=4).describe(batch)

    def slot(table: list[int], position: int) -> int:
        return table[position // 4] * 4 + position % 4

    assert step.input_ids.tolist() == [9, *range(1, 11)]
    assert step.positions.tolist() == [3, *range(10)]
    assert (step.q_seq_lens.tolist(), step.kv_seq_lens.tolist()) == ([1, 10], [4, 10])
    assert step.slot_mapping.tolist() == [slot(a.block_table, 3)] + [
        slot(b.block_table, p) for p in range(10)
    ]
    assert step.block_tables == [a.block_table, b.block_table]
    assert (step.selected_idxes.tolist(), step.sampled_request_ids) == ([0, 10], ["a", "b"])
    assert (step.placeholder_idxes, step.placeholder_request_ids) == ([], [])


def _step_with_placeholder() -> HostStep:
    """Request "b" decodes the token the previous step is still sampling for it (async)."""
    return HostStep(
        input_ids=np.array([7, PLACEHOLDER_TOKEN_ID], dtype=np.int32),
        positions=np.array([5, 2], dtype=np.int32),
        q_seq_lens=np.array([1, 1], dtype=np.int32),
        kv_seq_lens=np.array([6, 3], dtype=np.int32),
        block_tables=[[0, 1], [2]],
        slot_mapping=np.array([5, 10], dtype=np.int32),
        selected_idxes=np.array([0, 1], dtype=np.int32),
        sampled_request_ids=["a", "b"],
        placeholder_idxes=[1],
        placeholder_request_ids=["b"],
    )


def test_placeholders_take_the_previous_steps_token_of_their_request() -> None:
    builder = InputBuilder(torch.device("cpu"), "npu", block_size=4)
    previous = PreviousTokens(["c", "b", "a"], torch.tensor([11, 42, 99]))
    inputs = builder.upload(_step_with_placeholder(), previous)
    assert inputs.input_ids.tolist() == [7, 42]  # b's row of previous, not the row at index 1
    assert inputs.positions.tolist() == [5, 2] and inputs.sampled_request_ids == ["a", "b"]


def test_placeholders_without_their_token_are_refused() -> None:
    builder = InputBuilder(torch.device("cpu"), "npu", block_size=4)
    with pytest.raises(ValueError, match="none was given"):
        builder.upload(_step_with_placeholder())
    with pytest.raises(ValueError, match=r"sampled no token for \['b'\]"):
        builder.upload(_step_with_placeholder(), PreviousTokens(["a"], torch.tensor([1])))


class OpNames(TorchDispatchMode):
    """Records the name of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_placeholders_in_the_previous_steps_order_are_filled_by_one_copy() -> None:
    """Steady decode: a and b decode the tokens the step before samples for them, in that step's
    order, ahead of c's prompt chunk; their ids come from one copy, no gather or index upload."""
    builder = InputBuilder(torch.device("cpu"), "cuda", block_size=4)
    step = HostStep(
        input_ids=np.array([PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID, 5, 6, 7], dtype=np.int32),
        positions=np.array([4, 2, 0, 1, 2], dtype=np.int32),
        q_seq_lens=np.array([1, 1, 3], dtype=np.int32),
        kv_seq_lens=np.array([5, 3, 3], dtype=np.int32),
        block_tables=[[0, 1], [2], [3]],
        slot_mapping=np.array([4, 10, 12, 13, 14], dtype=np.int32),
        selected_idxes=np.array([0, 1, 4], dtype=np.int32),
        sampled_request_ids=["a", "b", "c"],
        placeholder_idxes=[0, 1],
        placeholder_request_ids=["a", "b"],
    )
    previous = PreviousTokens(["a", "b", "d"], torch.tensor([11, 42, 99]))
    with OpNames() as seen:
        inputs = builder.upload(step, previous)
    assert inputs.input_ids.tolist() == [11, 42, 5, 6, 7]
    assert not {"index_select", "index_copy", "index_copy_"} & set(seen.ops), seen.ops
    # the same step with the previous rows in another order takes the general gather
    reordered = PreviousTokens(["d", "b", "a"], torch.tensor([99, 42, 11]))
    assert builder.upload(step, reordered).input_ids.tolist() == [11, 42, 5, 6, 7]


@pytest.mark.parametrize("convention", ["cuda", "npu"])
def test_a_steady_decode_step_is_handed_on_as_host_tensors(convention: str) -> None:
    """Steady decode (async scheduling): every id is the token the step before sampled for the
    same row. The builder copies nothing to the device: the metadata, positions and slots stay
    host tensors (the executor stages them in one copy of its own) and the ids are the previous
    step's tokens where they are, with the lengths and layout written out by hand here."""
    step = HostStep(
        input_ids=np.array([PLACEHOLDER_TOKEN_ID] * 2, dtype=np.int32),
        positions=np.array([4, 2], dtype=np.int32),
        q_seq_lens=np.array([1, 1], dtype=np.int32),
        kv_seq_lens=np.array([5, 3], dtype=np.int32),
        block_tables=[[0, 1], [2]],
        slot_mapping=np.array([4, 10], dtype=np.int32),
        selected_idxes=np.array([0, 1], dtype=np.int32),
        sampled_request_ids=["a", "b"],
        placeholder_idxes=[0, 1],
        placeholder_request_ids=["a", "b"],
    )
    tokens = torch.tensor([11, 42], device="meta")
    builder = InputBuilder(torch.device("meta"), convention, block_size=4)
    with HostToDevice() as counter:
        inputs = builder.upload(step, PreviousTokens(["a", "b"], tokens))
    assert counter.copies == []
    assert inputs.input_ids.device.type == "meta" and inputs.input_ids.shape == (2,)
    md = inputs.metadata
    assert md.kind.name == "DECODE" and (md.num_seqs, md.num_tokens) == (2, 2)
    assert (md.max_query_len, md.max_seq_len) == (1, 5)
    assert md.q_cu_seq_lens.tolist() == [0, 1, 2] and md.kv_cu_seq_lens.tolist() == [0, 5, 8]
    assert md.q_seq_lens.tolist() == [1, 1] and md.kv_seq_lens_host.tolist() == [5, 3]
    assert md.block_table.tolist() == [[0, 1], [2, 0]] and md.slot_mapping.tolist() == [4, 10]
    assert inputs.positions.tolist() == [4, 2] and inputs.positions.is_cpu
    md.validate()
    # ids known on the host: the step is handed on whole, ids included
    known = dataclasses.replace(
        step, input_ids=np.array([7, 8], dtype=np.int32), placeholder_idxes=[],
        placeholder_request_ids=[],
    )  # fmt: skip
    with HostToDevice() as counter:
        inputs = builder.upload(known)
    assert counter.copies == [] and inputs.input_ids.tolist() == [7, 8]
