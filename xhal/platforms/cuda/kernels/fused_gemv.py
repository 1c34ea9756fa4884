"""Decode GEMVs with the op before them fused into their input: residual add + RMSNorm
(``add_rms_norm_gemv``: qkv after the input norm, gate_up after the post-attention norm) and the
SiLU gate (``silu_and_mul_gemv``: the down projection). Also the plain GEMV on the same program
layout (``stream_gemv``), with programmatic dependent launch as an option.

The kernels, what each fused prologue computes and how PDL and TMA enter them, are in
``fused_gemv_kernel.py``; this file checks the arguments, picks the launch shape
(``fused_gemv_config.py``) and launches them.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from xhal.platforms.cuda import pdl
from xhal.platforms.cuda.kernels.fused_gemv_config import (
    _NORM,
    _PLAIN,
    _SILU,
    PREVIOUS,
    TUNED,
    fused_gemv_config,
)
from xhal.platforms.cuda.kernels.fused_gemv_kernel import _fused_gemv_kernel, _fused_reduce_kernel
from xhal.platforms.cuda.kernels.gemv import _DTYPES, MAX_CORE_M, GemvConfig, _num_sms

__all__ = ["PREVIOUS", "TUNED", "fused_gemv_config"]  # with the three entry points below
_REDUCE_BLOCK = 1024


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"{name}: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        raise ValueError(
            f"{name}: x and weight must share one of {_DTYPES}, got {x.dtype} and {weight.dtype}"
        )
    if not 1 <= x.shape[0] <= MAX_CORE_M:
        raise ValueError(
            f"{name}: x has {x.shape[0]} rows; this kernel takes 1..{MAX_CORE_M} (use the unfused "
            f"ops)"
        )
    if weight.shape[1] != k or weight.shape[0] == 0 or k == 0:
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not take inputs of width {k}")
    if not weight.is_contiguous():
        raise ValueError(f"{name}: weight must be contiguous [N, K] (the nn.Linear layout)")


def supports(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether the fused GEMVs take ``x`` (``[M <= 16, K]``, or ``[M, 2K]`` gated) and
    ``weight [N, K]``: one float dtype, a contiguous weight."""
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    try:
        _check("fused_gemv", x, weight, k)
    except ValueError:
        return False
    return not gated or x.shape[-1] % 2 == 0


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    config: tuple[int, int, int, int, int] | None,
    use_pdl: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise ValueError(
            f"fused_gemv: bias must be [{N}] on {x.device}, got {tuple(bias.shape)} on "
            f"{bias.device}"
        )
    cfg = (
        GemvConfig(*config)
        if config is not None
        else fused_gemv_config(M, N, K, _num_sms(x.device), prologue)
    )
    pow2 = all(v >= 1 and not v & (v - 1) for v in (cfg.block_n, cfg.block_k))
    if not pow2 or min(cfg[:5]) < 1 or cfg.tma not in (0, 1):
        raise ValueError(
            f"fused_gemv: {cfg} needs power-of-2 block sizes, every field >= 1 and tma 0 or 1"
        )
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    summed = None
    res_arg, g_arg, sum_arg, res_stride = out, out, out, 0
    if prologue == _NORM:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        summed = torch.empty((M, K), dtype=x.dtype, device=x.device)
        res_arg, g_arg, sum_arg, res_stride = residual, norm_weight, summed, residual.stride(0)
    bias_arg = out if bias is None else bias.contiguous()
    part = (
        out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    )
    sq = (
        out
        if split_k == 1 or prologue != _NORM
        else torch.empty((split_k, M), dtype=torch.float32, device=x.device)
    )
    use_pdl = pdl.gemv_trigger(
        int(use_pdl), weight.numel() * weight.element_size(), norm=prologue == _NORM
    )
    pdl_options = pdl.launch_options(use_pdl)
    w_arg = weight
    if cfg.tma:  # a host-side descriptor: a kernel argument by value, so graph capture keeps it
        if (K * weight.element_size()) % 16 or weight.data_ptr() % 16:
            raise ValueError(
                f"fused_gemv: a TMA weight needs 16-byte aligned rows, got [{N}, {K}] "
                f"{weight.dtype} at {weight.data_ptr():#x} (use tma=0)"
            )
        w_arg = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    _fused_gemv_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
        x,
        res_arg,
        g_arg,
        w_arg,
        bias_arg,
        out,
        part,
        sum_arg,
        sq,
        N,
        x.stride(0),
        res_stride,
        eps,
        K=K,
        K_PER_SPLIT=k_per_split,
        M=M,
        BLOCK_M=triton.next_power_of_2(M),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PROLOGUE=prologue,
        SPLIT=split_k > 1,
        HAS_BIAS=bias is not None,
        NUM_STAGES=cfg.num_stages,
        USE_PDL=use_pdl,
        TMA=bool(cfg.tma),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options,
    )
    if split_k > 1:
        _fused_reduce_kernel[(triton.cdiv(M * N, _REDUCE_BLOCK),)](
            part,
            sq,
            bias_arg,
            out,
            N,
            M * N,
            eps,
            K=K,
            M=M,
            SPLIT_K=split_k,
            NORM=prologue == _NORM,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
            USE_PDL=use_pdl,
            **pdl_options,
        )
    return out, summed


def add_rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    use_pdl: int = pdl.OFF,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T + bias, x + residual)`` in one launch (two when K is
    split). Needs x, residual ``[M <= 16, K]`` (last dim contiguous or copied), weight ``[N, K]``
    contiguous, fp16 / bf16 / fp32; use_pdl (``pdl.OFF``, ``EARLY``, ``LATE`` or ``AUTO``; True
is EARLY) needs sm_90+. Graph-safe once compiled."""
    _check("add_rms_norm_gemv", x, weight, x.shape[-1])
    if residual.shape != x.shape or norm_weight.shape != (x.shape[-1],):
        raise ValueError(
            f"add_rms_norm_gemv: residual {tuple(residual.shape)} and norm weight "
            f"{tuple(norm_weight.shape)} "
            f"must be {tuple(x.shape)} and ({x.shape[-1]},)"
        )
    out, summed = _launch(_NORM, x, weight, bias, residual, norm_weight, eps, config, use_pdl)
    return out, summed


def silu_and_mul_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    use_pdl: int = pdl.OFF,
) -> torch.Tensor:
    """``(silu(x[:, :I]) * x[:, I:]) @ weight.T + bias`` in one launch (two when K is split).
    Needs x ``[M <= 16, 2I]``, weight ``[N, I]`` contiguous, fp16 / bf16 / fp32; use_pdl sm_90+."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul_gemv: x must be [M, 2I], got {tuple(x.shape)}")
    _check("silu_and_mul_gemv", x, weight, x.shape[-1] // 2)
    return _launch(_SILU, x, weight, bias, None, None, 0.0, config, use_pdl)[0]


def stream_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    use_pdl: int = pdl.OFF,
) -> torch.Tensor:
    """``x @ weight.T + bias`` on this file's layout (``gemv.gemv`` without the tensor-core
    path, with PDL as an option). Needs x ``[M <= 16, K]``, weight ``[N, K]`` contiguous."""
    _check("stream_gemv", x, weight, x.shape[-1])
    return _launch(_PLAIN, x, weight, bias, None, None, 0.0, config, use_pdl)[0]
