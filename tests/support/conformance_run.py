"""``xhal-conformance`` in a fresh process, as the tests that prove a plugin platform run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO


def suite_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a suite run: the repository importable (plugins are named
    ``tests.<module>``, also in the collective family's spawned ranks), no plugin or pytest flags
    inherited (only what the command line names), one thread (runs may share the machine),
    then ``overrides``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("XHAL_PLUGINS", None)
    env.pop("PYTEST_ADDOPTS", None)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **overrides}


def run_conformance(
    device: str, plugin: str, report: Path, families: tuple[str, ...] = (), **env: str
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``xhal-conformance --device DEVICE --plugin PLUGIN [--family F ...] --report REPORT``; the
    finished process and the report (None when none was written)."""
    cmd = [sys.executable, "-m", "conformance_tests.cli", "--device", device, "--plugin", plugin]
    for family in families:
        cmd += ["--family", family]
    cmd += ["--report", str(report)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=suite_env(**env), capture_output=True, text=True, timeout=600
    )
    return proc, json.loads(report.read_text()) if report.exists() else None


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
