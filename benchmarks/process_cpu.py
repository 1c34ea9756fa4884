"""CPU seconds a process and its children spend, read from Linux's /proc: what tells which
process of a server (the API process, the engine process, the client) bounds a token rate."""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (its threads included, children not)."""
    # the command name (field 2) may hold spaces: the fields after it follow the last ')'
    fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)


def snapshot(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and of each of its children, by pid."""
    if not (_PROC / str(pid)).is_dir():
        raise ValueError(f"no process {pid} (reading /proc/{pid}: Linux only)")
    out = {pid: cpu_seconds(pid)}
    for child in children(pid):
        try:
            out[child] = cpu_seconds(child)
        except OSError:
            pass
    return out
