"""The CUDA platform's Triton fallback attention (``TritonAttention``: plan, KV write, paged
attention) through the conformance attention family, its kernels in Triton's interpreter on the
CPU (``tests/support/triton_interpreted_platform.py``). Interpreted kernels are slow, so one dtype
and block size of the non-prefill cases run here (the kernels' own tests cover prefill); the whole
family runs compiled on the GPU."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.conformance_run import REPO, suite_env
from tests.support.triton_env import NO_RUNTIME_LOOPS, RUNTIME_LOOPS

# long contexts run compiled on the GPU: the interpreter takes minutes per thousand keys. The
# plugin builds the Triton backend whatever attention solution a case forces, so the CPU's second
# attention solution ("sdpa", cpu-fast's) would run the same kernels again: its cases are left out.
CASES = "bfloat16 and bs16 and not prefill and not d256 and not long_context and not sdpa"


def _suite(*extra: str) -> subprocess.CompletedProcess[str]:
    env = suite_env(XHAL_PLUGINS="tests.support.triton_interpreted_platform", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-W", "ignore::DeprecationWarning", "conformance_tests/test_attention.py",
           "--device", "cuda-triton-interpreted", "-k", CASES, *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _count(pattern: str, proc: subprocess.CompletedProcess[str]) -> int:
    """The number ``pattern`` finds in pytest's summary (the last line of its output)."""
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    found = re.search(pattern, summary)
    return int(found.group(1)) if found else 0


@pytest.mark.skipif(not RUNTIME_LOOPS, reason=f"paged attention {NO_RUNTIME_LOOPS}")
def test_triton_attention_passes_the_attention_family_interpreted() -> None:
    """Judged by the exit code and by the count: every case the selection collects passes (none
    skipped, none deselected by a crash), and the selection is not empty."""
    listed = _suite("--collect-only")
    assert listed.returncode == 0, f"{listed.stdout[-4000:]}\n{listed.stderr[-2000:]}"
    collected = _count(r"(\d+)(?:/\d+)? tests? collected", listed)
    assert collected > 0, listed.stdout[-2000:]
    proc = _suite()
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    assert _count(r"(\d+) passed", proc) == collected, proc.stdout[-2000:]
