"""The events that let a reused pinned buffer be rewritten: whatever the host's lead, a buffer is
never rewritten before the copy last queued from it has run, and a steady step costs a record and
a wait only once per group."""

from __future__ import annotations

import pytest

from xhal.executor.upload_fences import UploadFences


class Device:
    """A device that runs queued uploads only when the host waits on an event after them (the
    worst case: the host as far ahead as it likes)."""

    def __init__(self) -> None:
        self.queued = 0  # uploads queued so far
        self.ran = 0  # uploads the device has run (in order)
        self.records = self.waits = 0

    def event(self) -> Event:
        return Event(self)


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.after = device, None

    def record(self) -> None:
        self.device.records += 1
        self.after = self.device.queued

    def synchronize(self) -> None:
        assert self.after is not None, "waited on an event never recorded"
        self.device.waits += 1
        self.device.ran = max(self.device.ran, self.after)


@pytest.mark.parametrize(
    "slots, group", [(8, 4), (4, 4), (5, 2), (3, 1), (8, 3), (32, 16), (9, 4)]
)
def test_no_buffer_is_rewritten_before_its_last_copy_ran(slots: int, group: int) -> None:
    device = Device()
    fences = UploadFences(slots, group, device.event)
    steps = 10 * slots + 3
    for t in range(steps):
        fences.before(t)
        if t >= slots:  # upload t - slots read this buffer; it must have run
            assert device.ran >= t - slots + 1, (t, device.ran)
        device.queued += 1  # the copy of upload t
        fences.after(t)
    assert device.records == steps // group
    assert device.waits <= device.records


def test_a_device_that_keeps_up_is_never_waited_on_twice_for_the_same_uploads() -> None:
    device = Device()
    fences = UploadFences(8, 4, device.event)
    for t in range(64):
        fences.before(t)
        device.queued += 1
        fences.after(t)
    assert device.waits == (64 - 8) // 4  # one wait per group of reused buffers


def test_a_group_larger_than_the_ring_is_refused() -> None:
    with pytest.raises(ValueError, match="group"):
        UploadFences(2, 3, Device().event)
