"""benchmarks/process_cpu.py against the kernel's own clocks: /proc's CPU ticks of this process
match ``time.process_time`` (to the tick), and a child started here is found as a child."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.process_cpu import children, cpu_seconds, snapshot

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_cpu_seconds_follow_the_process_clock() -> None:
    p0, c0 = time.process_time(), cpu_seconds(os.getpid())
    while time.process_time() - p0 < 0.3:  # burn CPU time, not wall time
        sum(range(1000))
    p1, c1 = time.process_time(), cpu_seconds(os.getpid())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert abs((c1 - c0) - (p1 - p0)) <= 3 * tick + 0.1 * (p1 - p0)


def test_a_child_is_found_and_a_missing_pid_is_refused() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert child.pid in children(os.getpid())
        assert set(snapshot(os.getpid())) >= {os.getpid(), child.pid}
    finally:
        child.communicate(b"")
    with pytest.raises(ValueError, match="no process"):
        snapshot(2**22 + 12345)  # above Linux's pid_max
