"""Linux process checks the server tests share: which children a process spawned, whether a
process is still alive, waiting until a set of them is gone, and waiting for any condition.

Waits poll an event (a process gone, a metric reached, a log line written) under a generous
bound, never a fixed sleep: a loaded CI machine may be many times slower than a laptop, and a
bound only decides how long a real failure takes to be reported."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def spawned_children(pid: int) -> list[int]:
    """``pid``'s children started by multiprocessing's spawn (the engine, the TP workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = []
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            spawned.append(int(child))
    return spawned


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait() is missing


GENEROUS_S = 120.0


def wait_for(condition: Callable[[], object], message: str, timeout: float = GENEROUS_S) -> None:
    """Poll ``condition`` until it is true; fail with ``message`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{message} (after {timeout:.0f} s)"
        time.sleep(0.05)


def wait_gone(pids: list[int], message: str, timeout: float = GENEROUS_S) -> None:
    """Wait up to ``timeout`` seconds for every process in ``pids`` to exit; else fail with
    ``message``."""
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], message
