"""One device buffer of named int32 fields written from rotating host buffers: the layout keeps
every field apart and aligned, a step's copy carries exactly its first ``count`` values, and a host
buffer keeps what its own last step wrote."""

from __future__ import annotations

import numpy as np
import torch

from xhal.executor.packed_inputs import PackedInputs, ring_slots

SHAPES = {"ids": (3,), "slots": (3,), "width": (1,), "table": (2, 5)}


def _packed(slots: int = 2) -> PackedInputs:
    return PackedInputs(SHAPES, {"slots": -1}, torch.device("cpu"), slots=slots, group=1)


def test_fields_are_aligned_apart_and_start_at_their_initial_values() -> None:
    packed = _packed()
    assert list(packed.offsets.values()) == [0, 16, 32, 48]  # 64-byte starts
    assert packed.size == 64
    for name, shape in SHAPES.items():
        view = packed.views[name]
        assert view.shape == shape and view.dtype == torch.int32
        assert view.data_ptr() == packed.buffer.data_ptr() + 4 * packed.offsets[name]
    assert packed.views["slots"].tolist() == [-1, -1, -1]
    assert packed.views["table"].abs().sum() == 0


def test_upload_copies_the_first_count_values_of_the_buffer_just_filled() -> None:
    packed = _packed()
    host = packed.begin()
    host["ids"][:] = [7, 8, 9]
    host["slots"][:2] = [40, 41]
    host["table"][0] = [1, 2, 3, 4, 5]
    host["table"][1] = [6, 7, 8, 9, 10]
    packed.upload(packed.offsets["table"] + 7)  # the table's first row and two of the second
    assert packed.views["ids"].tolist() == [7, 8, 9]
    assert packed.views["slots"].tolist() == [40, 41, -1]
    assert packed.views["table"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]


def test_host_buffers_take_turns_and_keep_their_own_values() -> None:
    """With two buffers a step writes the one its last-but-one predecessor wrote: a value the step
    leaves alone is that step's, not the previous step's."""
    packed = _packed(slots=2)
    written = []
    for step in range(4):
        host = packed.begin()
        if step < 2:
            host["ids"][:] = 10 * (step + 1)
        written.append(host["ids"].copy())
        packed.upload(packed.offsets["slots"])
        assert packed.views["ids"].tolist() == written[-1].tolist()
    np.testing.assert_array_equal(written[2], written[0])
    np.testing.assert_array_equal(written[3], written[1])
    assert written[0].tolist() != written[1].tolist()


def test_the_ring_fills_a_small_pinned_budget_and_fences_every_half_of_it() -> None:
    """A decode graph's buffer of a few tens of KB gets 32 host buffers, fenced every 16 uploads
    (an event call in one step of 16, off the median step); a buffer of MBs gets 8, never
    fewer; the budget is what bounds the ones between."""
    assert ring_slots(4) == ring_slots(40 << 10) == 32
    assert ring_slots(1 << 20) == 8 and ring_slots(64 << 20) == 8
    assert ring_slots(512 << 10) == 16
    small = PackedInputs(SHAPES, {}, torch.device("cpu"))
    assert (small.slots, small.group) == (32, 16)
    big = PackedInputs({"table": (1 << 20,)}, {}, torch.device("cpu"))
    assert (big.slots, big.group) == (8, 4)
