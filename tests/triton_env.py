"""Set-up and the float64 comparison shared by the Triton kernel tests: without a CUDA device the kernels run in Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is imported); with one they
run compiled on the GPU. Importing this skips the importing test module when triton is missing."""

from __future__ import annotations

import os

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
    assert err <= TOL[dtype] * ref.abs().max().item(), err
