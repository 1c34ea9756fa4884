"""Fused residual add + RMSNorm, out of place, in one launch (one program per row).

FlashInfer's fused kernel works in place; keeping our op's out-of-place contract with it costs two
copies per call, three launches where this takes one. With programmatic dependent launch
(``pdl.py``) a program loads the norm weight before waiting for the kernel that produced x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda import pdl


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, x_stride, res_stride, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if USE_PDL:  # the weight first, then wait for x and the residual (every program: pdl.py)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(sum_ptr.dtype.element_ty)  # the residual stream keeps the input dtype
    tl.store(sum_ptr + row * N + offs, summed, mask=mask)
    s = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    if not USE_PDL:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (s * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    use_pdl: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = x + residual`` (in x's dtype), ``normed = rms_norm(summed) * weight``; new
    tensors, inputs untouched. ``use_pdl`` defaults to ``pdl.small_kernel(x.device)``."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    normed, summed = x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, whatever x's strides
    rows = x2.shape[0]
    use_pdl = pdl.small_kernel(x.device) if use_pdl is None else int(bool(use_pdl))
    if rows:
        block = triton.next_power_of_2(n)
        _fused_add_rms_norm_kernel[(rows,)](
            x2, r2, weight, normed, summed, x2.stride(0), r2.stride(0), eps, N=n, BLOCK=block,
            USE_PDL=use_pdl, num_warps=min(16, max(1, block // 256)), **pdl.launch_options(use_pdl),
        )
    return normed, summed
