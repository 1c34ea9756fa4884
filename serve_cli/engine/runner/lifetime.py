"""Child processes that die with their parent: the engine process and its tensor-parallel
workers arm this first thing, so no orphan outlives a killed parent."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(parent_pid: int) -> bool:
    """Ask Linux to SIGTERM this process when its parent dies (``PR_SET_PDEATHSIG``); returns
    False when the parent is already gone (it died before the signal was armed). Long loops also
    compare ``os.getppid()`` with ``parent_pid`` where they can."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return os.getppid() == parent_pid
