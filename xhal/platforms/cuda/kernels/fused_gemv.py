"""Decode GEMVs with the op before them fused into their input: residual add + RMSNorm
(``add_rms_norm_gemv``: qkv after the input norm, gate_up after the post-attention norm) and the
SiLU gate (``silu_and_mul_gemv``: the down projection). Also the plain GEMV on the same program
layout (``stream_gemv``), with programmatic dependent launch as an option.

The program layout is ``gemv.py``'s (BLOCK_N weight rows, one K range, products kept unreduced
until the loop ends, a deterministic split-K reduce); its launch shapes are in
``fused_gemv_config.py``. What is fused is computed on the x tile a program loads anyway, so the
weight stream is unchanged and one launch (plus the reduce when K is split) replaces two or three:

- norm: each step adds the residual tile (rounded to the dtype, as the unfused op stores it),
  multiplies by the norm weight and accumulates the sum of squares next to the products; the
  row's ``1 / rms`` is a scalar, so it scales the finished dot product (or the split-K reduce
  does, from each split's sum of squares). The normed input is therefore not rounded to the
  dtype before the product, one rounding fewer than the unfused sequence (see the conformance
  fused family for the tolerance). Programs of the first row block also store the new residual.
- silu: ``silu(gate) * up`` rounded to the dtype, exactly the unfused op's input to the GEMV.

Programmatic dependent launch (sm_90+, ``use_pdl``, the rule in ``xhal/platforms/cuda/pdl.py``):
the kernel is launched with the PDL attribute, so it is scheduled while the previous kernel
drains; it loads its first weight tile (weights never depend on earlier kernels) and then waits
(``griddepcontrol``) before its first load of x; it lets the next kernel launch right after that
wait (``pdl.EARLY``) or after its weight stream (``pdl.LATE``). ``use_pdl=0`` compiles the kernel
without any of it.

Weight tiles through TMA (``GemvConfig.tma``): Triton's pipeliner keeps ``num_stages - 1`` tiles
of a tensor-descriptor load in flight in shared memory whether or not they feed a ``tl.dot``,
where the plain loads leave a program about one tile in flight (``fused_gemv_config.py``). The
descriptor is built on the host per launch (a kernel argument, so a captured graph keeps it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
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
from xhal.platforms.cuda.kernels.gemv import _DTYPES, MAX_CORE_M, GemvConfig, _num_sms

__all__ = ["PREVIOUS", "TUNED", "fused_gemv_config"]  # with the three entry points below
_REDUCE_BLOCK = 1024


@triton.jit
def _input(
    x_rows, ks, k_mask, xm, res_ptr, res_stride, g_ptr, sum_ptr, ms, store_sum, dtype,
    K: tl.constexpr, PROLOGUE: tl.constexpr,
):
    """The GEMV's input at columns ``ks`` (the fused op applied to the x tile), fp32 [BLOCK_M, W],
    and (norm only: callers ignore it otherwise) the squares of the summed input for 1/rms."""
    if PROLOGUE == 1:  # residual add + RMSNorm, 1/rms applied after the loop
        x = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + ms[:, None] * res_stride + ks[None, :], mask=xm, other=0.0)
        s = (x + r.to(tl.float32)).to(dtype)  # the residual stream keeps the input dtype
        tl.store(sum_ptr + ms[:, None] * K + ks[None, :], s, mask=xm & store_sum)
        s = s.to(tl.float32)
        a = s * tl.load(g_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        return a, s * s
    elif PROLOGUE == 2:  # silu(gate) * up, rounded as the unfused op stores it
        gate = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        a = (gate * tl.sigmoid(gate) * up).to(dtype).to(tl.float32)
        return a, a
    else:
        a = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        return a, a


@triton.jit
def _flush(
    out, sumsq, block, ms, m_mask, rows, row_mask, N, pid_k, eps, bias_ptr, out_ptr, part_ptr,
    sq_ptr, dtype, K: tl.constexpr, M: tl.constexpr, PROLOGUE: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One row block's epilogue: [BLOCK_M, BLOCK_N] fp32 dot products (and the rows' sum of
    squares) scaled, biased and stored, or stored as this split's partials."""
    if PROLOGUE == 1:
        if SPLIT:  # the split's sum of squares, the same for every row block: block 0 stores it
            tl.store(sq_ptr + pid_k * M + ms, sumsq, mask=m_mask & (block == 0))
        else:
            out = out * tl.rsqrt(sumsq / K + eps)[:, None]
    offs = ms[:, None] * N + rows[None, :]
    mask = m_mask[:, None] & row_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + offs, out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, out.to(dtype), mask=mask)


@triton.jit
def _weight_tile(w_ptr, rows, row_mask, ks, k_mask, row0, k0, K: tl.constexpr, TMA: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at rows ``row0``.., columns ``k0``..: through the TMA
    descriptor ``w_ptr`` (out-of-range rows and columns read as zeros), which Triton's pipeliner
    keeps ``num_stages - 1`` tiles ahead in shared memory (it pipelines plain loads only when they
    feed a ``tl.dot``), or a masked plain load."""
    if TMA:
        w = w_ptr.load([row0, k0])
    else:
        w = tl.load(
            w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
    return w


@triton.jit
def _fused_gemv_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, sum_ptr, sq_ptr,
    N, x_stride, res_stride, eps,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    TMA: tl.constexpr = False,
):
    STEPS: tl.constexpr = K_PER_SPLIT // BLOCK_K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_mask = ms < M
    x_rows = x_ptr + ms[:, None] * x_stride
    dtype = out_ptr.dtype.element_ty
    k_start = pid_k * K_PER_SPLIT
    # the first step is peeled: its weight tile (weights never depend on the previous kernel) is
    # loaded before waiting for that kernel under PDL, so the stream starts during its tail
    ks = k_start + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    w = _weight_tile(w_ptr, rows, row_mask, ks, k_mask, pid_n * BLOCK_N, k_start, K, TMA)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) come from the previous kernel
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    a, q = _input(
        x_rows, ks, k_mask, m_mask[:, None] & k_mask[None, :], res_ptr, res_stride, g_ptr,
        sum_ptr, ms, pid_n == 0, dtype, K, PROLOGUE,
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
    sq = q if PROLOGUE == 1 else tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for t in tl.range(1, STEPS, num_stages=NUM_STAGES):
        ks = k_start + t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = _weight_tile(
            w_ptr, rows, row_mask, ks, k_mask, pid_n * BLOCK_N, k_start + t * BLOCK_K, K, TMA
        )
        a, q = _input(
            x_rows, ks, k_mask, m_mask[:, None] & k_mask[None, :], res_ptr, res_stride, g_ptr,
            sum_ptr, ms, pid_n == 0, dtype, K, PROLOGUE,
        )
        acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
        if PROLOGUE == 1:
            sq += q
    if USE_PDL == 2:  # the weights are streamed: the next kernel's programs may take the SMs
        tl.extra.cuda.gdc_launch_dependents()
    _flush(
        tl.sum(acc, axis=2),  # [BLOCK_M, BLOCK_N]
        tl.sum(sq, axis=1),  # [BLOCK_M], this split's part
        pid_n, ms, m_mask, rows, row_mask, N, pid_k, eps, bias_ptr, out_ptr, part_ptr, sq_ptr,
        dtype, K, M, PROLOGUE, SPLIT, HAS_BIAS,
    )


@triton.jit
def _fused_reduce_kernel(
    part_ptr,
    sq_ptr,
    bias_ptr,
    out_ptr,
    N,
    MN,
    eps,
    K: tl.constexpr,
    M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    m = offs // N
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits every run
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if NORM:
            ss += tl.load(sq_ptr + s * M + m, mask=mask, other=0.0)
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
