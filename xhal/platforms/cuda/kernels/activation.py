"""Gated activations (``silu_and_mul``, ``gelu_and_mul`` exact and tanh) in one launch, for any
number of rows and any width: ``act(x[..., :d]) * x[..., d:]`` in float32, rounded once to x's
dtype, the semantics of the CPU reference.

Why a kernel of our own: the torch sequence (``x.float()``, the activation, the product, the cast
back) is four launches and three float32 intermediates; in a batch-64 decode step it cost about
16 us per layer against ~2 us for one pass over the gate | up tensor (docs/h200-results.md).
FlashInfer's takes only 16-byte aligned, contiguous fp16 / bf16 halves, and its tanh form is off
by more than a rounding in fp16; this one takes every row stride, width and dtype.

With programmatic dependent launch (``pdl.py``: a small kernel, triggering right after its wait)
its programs are scheduled while the gate_up GEMM ahead drains; they load nothing before the wait,
since everything they read is that GEMM's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda import pdl

SILU, GELU, GELU_TANH = 0, 1, 2  # the ACT constexpr
_ACTS = {"silu": SILU, "none": GELU, "tanh": GELU_TANH}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024  # elements of the output row per program: 16-byte loads for 4 warps of bf16


@triton.jit
def _gated_activation_kernel(
    x_ptr, out_ptr, x_stride, out_stride, D, ACT: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # every program waits (pdl.py, rule 2), then lets the next kernel launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + D + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        # gate / (1 + e^-gate): -0.0 rather than NaN where e^-gate overflows
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        # tanh(y) = 1 - 2 / (e^2y + 1): exact limits (+-1) where e^2y overflows or vanishes
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        act = 0.5 * gate * (1.0 + tanh)
    tl.store(out_ptr + row * out_stride + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x``: a float16 / bfloat16 / float32 tensor of an even last
    dimension (any leading shape and row stride)."""
    return x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0


def gated_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``x = gate | up`` along the last dimension; a new contiguous tensor
    of x's dtype and shape ``[..., d]``. ``activation``: ``"silu"``, or GELU's ``"none"`` (erf)
    or ``"tanh"``."""
    if activation not in _ACTS:
        raise ValueError(
            f"unknown gated activation {activation!r}: expected one of {sorted(_ACTS)}"
        )
    if not supports(x):
        raise ValueError(
            f"gated_activation takes float16 / bfloat16 / float32 with an even last dimension, "
            f"got {x.dtype} of shape {tuple(x.shape)}: call the torch sequence for this input"
        )
    d = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], d)
    x2 = x.reshape(-1, 2 * d)  # a view where the leading dims allow it
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    use_pdl = pdl.small_kernel(x.device)
    if rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        grid = (rows, triton.cdiv(d, block))
        _gated_activation_kernel[grid](
            x2, out, x2.stride(0), d, d, ACT=_ACTS[activation], BLOCK=block, USE_PDL=use_pdl,
            num_warps=max(1, min(4, block // 256)), **pdl.launch_options(use_pdl),
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return gated_activation(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul's approximate is 'none' or 'tanh', got {approximate!r}")
    return gated_activation(x, approximate)
