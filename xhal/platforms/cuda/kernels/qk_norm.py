"""Qwen3's per-head RMSNorm of q and k (``DeviceOps.qk_rms_norm``) in one launch: two norm
launches per layer become one, each program norming ``HEADS`` heads of one token, q's heads and
k's heads alike (each with its own weight), read from the strided slices of the qkv projection
and written contiguous. With programmatic dependent launch (``pdl.py``) a program loads the two
norm weights before waiting for the projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda import pdl

HEADS = 8  # heads per program: Qwen3-30B-A3B's 32 + 4 heads are 5 programs per token
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor) -> bool:
    head_dim = q_weight.shape[0]
    return (
        q.dim() == 2
        and k.dim() == 2
        and q.shape[0] == k.shape[0]
        and q.shape[1] % head_dim == 0
        and k.shape[1] % head_dim == 0
        and q.dtype in _DTYPES
        and k.dtype == q.dtype
        and q.stride(1) == 1
        and k.stride(1) == 1
        and head_dim <= 1024
    )


@triton.jit
def _qk_norm_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, q_stride, k_stride, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr, USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # q's heads, then k's
    is_q = heads < H
    is_k = (heads >= H) & (heads < H + HKV)
    ds = tl.arange(0, BLOCK_D)
    dm = ds < D
    q_off = heads[:, None] * D + ds[None, :]
    k_off = (heads - H)[:, None] * D + ds[None, :]
    q_mask, k_mask = is_q[:, None] & dm[None, :], is_k[:, None] & dm[None, :]
    if USE_PDL:  # the weights first, then wait for q and k (every program waits: pdl.py)
        wq = tl.load(qw_ptr + ds, mask=dm, other=0.0).to(tl.float32)
        wk = tl.load(kw_ptr + ds, mask=dm, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(q_ptr + token * q_stride + q_off, mask=q_mask, other=0.0).to(tl.float32)
    x += tl.load(k_ptr + token * k_stride + k_off, mask=k_mask, other=0.0).to(tl.float32)
    if not USE_PDL:
        wq = tl.load(qw_ptr + ds, mask=dm, other=0.0).to(tl.float32)
        wk = tl.load(kw_ptr + ds, mask=dm, other=0.0).to(tl.float32)
    w = tl.where(is_q[:, None], wq[None, :], wk[None, :])
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = (x * inv_rms[:, None] * w).to(q_out_ptr.dtype.element_ty)
    tl.store(q_out_ptr + token * (H * D) + q_off, y, mask=q_mask)
    tl.store(k_out_ptr + token * (HKV * D) + k_off, y, mask=k_mask)


def qk_rms_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    use_pdl: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeviceOps.qk_rms_norm`` for inputs ``supports`` accepts; ``use_pdl`` defaults to
    ``pdl.small_kernel(q.device)``."""
    head_dim, num_tokens = q_weight.shape[0], q.shape[0]
    num_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out = q.new_empty(q.shape)  # contiguous, unlike the strided input slices
    k_out = k.new_empty(k.shape)
    use_pdl = pdl.small_kernel(q.device) if use_pdl is None else int(bool(use_pdl))
    if num_tokens:
        grid = (num_tokens, triton.cdiv(num_heads + num_kv_heads, HEADS))
        _qk_norm_kernel[grid](
            q, k, q_weight.contiguous(), k_weight.contiguous(), q_out, k_out,
            q.stride(0), k.stride(0), eps,
            H=num_heads, HKV=num_kv_heads, D=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), HEADS=HEADS, USE_PDL=use_pdl, num_warps=4,
            **pdl.launch_options(use_pdl),
        )
    return q_out, k_out
