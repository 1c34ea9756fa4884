"""When a reused page-locked buffer may be rewritten: one event per group of uploads, not per
upload.

A host buffer that an asynchronous copy reads must not be rewritten before that copy has run.
An event after every copy and a wait before every rewrite is correct, but each is a call into
torch (several microseconds of host time on a GPU host, as much as the copy itself). The device
runs one stream in order, so an event recorded after upload ``j`` also covers every upload
before it: recording one after every ``group``-th upload and waiting, before upload ``t`` reuses
the buffer of upload ``t - slots``, on the first event recorded at or after that upload costs two
calls per ``group`` steps. That event is always recorded already (``group <= slots``); the host
blocks only when it runs about ``slots - group`` uploads ahead of the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UploadFences:
    """``before(t)`` ahead of writing the buffer of upload ``t`` (``t`` = 0, 1, 2, ... in order),
    ``after(t)`` once its copy is queued. ``make_event()`` returns an object with ``record()`` and
    ``synchronize()`` (``torch.Event``)."""

    def __init__(self, slots: int, group: int, make_event: Callable[[], Any]) -> None:
        if not 1 <= group <= slots:
            raise ValueError(f"group must be in [1, slots={slots}], got {group}")
        self.slots, self.group = slots, group
        # events in use: at most slots // group + 1 are ever waited on, the oldest beyond that
        # is reused by the next record
        self._events = [make_event() for _ in range(slots // group + 2)]
        self._recorded: list[int] = [-1] * len(self._events)  # upload index each one follows
        self._done = -1  # every upload up to this index is known to have run

    def before(self, t: int) -> None:
        needed = t - self.slots  # the upload that last read this buffer
        if needed <= self._done:
            return
        # the first fence at or after ``needed``: recorded at the end of its group
        fence = needed + self.group - 1 - needed % self.group
        i = (fence // self.group) % len(self._events)
        assert self._recorded[i] == fence, (fence, self._recorded)
        self._events[i].synchronize()
        self._done = fence

    def after(self, t: int) -> None:
        if t % self.group == self.group - 1:
            i = (t // self.group) % len(self._events)
            self._events[i].record()
            self._recorded[i] = t
