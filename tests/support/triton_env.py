"""Set-up and the float64 comparison shared by the Triton kernel tests: without a CUDA device the
kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is
imported); with one they run compiled on the GPU. Importing this skips the importing test module
when triton is missing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the Triton kernels need triton (xhal[cuda])")
tl = pytest.importorskip("triton.language")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

TOL = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-5}  # fp16 / bf16: their eps


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    # within one unit in the last place at the output's largest magnitude: fp32 accumulation
    # plus the final rounding; a missed or doubled K tile is off by whole units
    err = (out.double() - ref).abs().max().item()
    tol = TOL[dtype]
    if INTERPRETED and dtype == torch.bfloat16:
        # Triton 3.6's interpreter truncates float32 -> bfloat16 instead of rounding to nearest
        # (half of 4096 random values differ), so a kernel that rounds an intermediate to bf16
        # (the residual of fused add+RMSNorm) is one more unit off there; compiled on the GPU
        # the conformance ops family holds the same kernels to 1 ulp
        tol *= 2
    assert err <= tol * ref.abs().max().item(), err


@triton.jit
def _loop_to(out_ptr, n):
    total = 0
    for i in range(n):
        total += i
    tl.store(out_ptr, total)


def _runtime_loop_bounds_work() -> bool:
    """Whether this Triton runs a loop whose bound is a kernel argument. Triton 3.6's interpreter
    turns such a bound into a Python int with ``int()`` of a 1-element array, which numpy 2.4
    rejects; compiled kernels are not affected."""
    if not INTERPRETED:
        return True
    out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    try:
        _loop_to[(1,)](out, 4)
    except triton.runtime.errors.InterpreterError:
        return False
    return out.item() == 6


RUNTIME_LOOPS = _runtime_loop_bounds_work()
NO_RUNTIME_LOOPS = (
    f"loops to a runtime bound, which Triton {triton.__version__}'s interpreter cannot run under "
    f"numpy {np.__version__} (int() of a 1-element array; the test extra pins "
    "numpy < 2.4); compiled on CUDA it runs"
)
