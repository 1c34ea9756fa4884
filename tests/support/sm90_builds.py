"""Runs a test module as a script in a child process that compiles Triton kernels for sm_90
(no GPU needed) and prints JSON: the child has the interpreter off and this tree's kernels first
on its path. A kernel of ours that fails to compile fails the test; a Triton that cannot target
sm_90 at all skips it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compiled_in_child(script: str) -> object:
    """The JSON ``script`` (a test module's ``__file__``, run as ``__main__``) prints."""
    pytest.importorskip("triton")
    # compiled, not interpreted: "0" also keeps triton_env from setting it in the child; this
    # tree's kernels, not those of whichever tree the environment installed
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    if done.returncode != 0:
        error = done.stderr.strip()[-1200:]
        if "CompilationError" in done.stderr:
            pytest.fail(f"a kernel failed to compile for sm_90:\n{error}")
        pytest.skip(f"Triton cannot compile for sm_90 here: {error[-400:]}")
    return json.loads(done.stdout)
