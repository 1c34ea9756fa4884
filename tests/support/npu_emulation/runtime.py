"""Emulated ``torch.npu`` runtime services: device queries, streams, events
(``torch_npu/npu/streams.py`` of the wheel).

The emulated device is the CPU, and work runs synchronously when it is issued, so a stream is only
a name that graph capture and the update protocol check. The one asynchronous thing emulated is a
graph replay blocked on a captured ``ExternalEvent.wait`` (see ``graph.py``): ``synchronize``
raises while one is blocked, because on a device it would hang there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

EMULATED_DEVICE = torch.device("cpu")

# graphs whose replay is parked on an ExternalEvent nobody recorded (filled by graph.py)
blocked_replays: list[Any] = []
# stream -> graph capturing on it (filled by graph.py)
capturing: dict[Stream, Any] = {}


class Stream:
    """A named queue. ``torch.npu.Stream(device=None, priority=0)``."""

    _next_id = 0

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        Stream._next_id += 1
        self.stream_id = Stream._next_id
        self.priority = priority
        self.device = EMULATED_DEVICE

    def synchronize(self) -> None:
        _check_not_capturing("Stream.synchronize")
        _check_no_blocked_replay()

    def query(self) -> bool:
        return not blocked_replays

    def wait_stream(self, other: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        kind = "default" if self is _default_stream else "side"
        return f"<emulated torch.npu.Stream {self.stream_id} ({kind})>"


_default_stream = Stream()
_current: list[Stream] = [_default_stream]


def current_stream(device: Any = None) -> Stream:
    return _current[-1]


def default_stream(device: Any = None) -> Stream:
    return _default_stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """``with torch.npu.stream(s):`` makes ``s`` current inside the block."""
    if s is None:
        yield
        return
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


class Event:
    """``torch.npu.Event``: work is synchronous here, so an event is always complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _check_no_blocked_replay()


def _check_not_capturing(what: str) -> None:
    if current_stream() in capturing:
        raise RuntimeError(
            f"{what} called while {current_stream()!r} is capturing a graph: a host sync is "
            "illegal under NPU graph capture (emulated torch_npu)"
        )


def _check_no_blocked_replay() -> None:
    if blocked_replays:
        raise RuntimeError(
            f"synchronize would hang: {len(blocked_replays)} NPUGraph replay(s) are blocked on a "
            "captured ExternalEvent.wait that was never recorded. Update the graph (g.update(...) "
            "or graph_task_update_begin/end + event.record(update_stream)) before or right after "
            "every replay (emulated torch_npu)"
        )


def synchronize(device: Any = None) -> None:
    _check_not_capturing("torch.npu.synchronize")
    _check_no_blocked_replay()


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


_current_device = 0


def set_device(device: int | str | torch.device) -> None:
    global _current_device
    index = device.index if isinstance(device, torch.device) else device
    if isinstance(index, str):
        index = int(index.split(":")[-1]) if ":" in index else 0
    if index not in (None, 0):
        raise RuntimeError(f"set_device({device!r}): the emulation has one device, index 0")
    _current_device = 0


def current_device() -> int:
    return _current_device


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """Host memory stands in for device memory: ``(free_bytes, total_bytes)``."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def empty_cache() -> None:
    pass


def get_device_name(device: Any = None) -> str:
    return "emulated Ascend NPU (CPU; tests only)"
