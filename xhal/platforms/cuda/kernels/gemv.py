"""Small-M matmul (decode GEMV): ``x @ weight.T (+ bias)`` for x [M <= 64, K], weight read once.

cuBLAS streams small decode weights (e.g. a 4096 x 4096 o_proj at batch 1) well below HBM rate.
Here each program owns BLOCK_N weight rows and one K range: per step it loads a [BLOCK_N, BLOCK_K]
weight tile once and multiplies it with all M rows of x. Up to 16 rows that is CUDA-core math,
the products kept unreduced until the loop ends; from 17 to 64 rows the tile goes through
``tl.dot`` (tensor cores), x padded to 32 or 64 rows. (At batch 64 cuBLAS streams the 8B shape's
qkv and o projections at 66-69% of the copy ceiling on the H200, with fewer programs than SMs;
the tensor-core path is for that case, and CudaOps does not use it until bench_gemv measures it
faster.) When the row blocks alone cannot fill the chip, K is split: stage 1 writes fp32
partials [SPLIT_K, M, N], stage 2 sums them in a fixed order (deterministic, no atomics), adds
the bias and casts. Both launches allocate only with torch.empty, so the call is safe inside CUDA
graph capture (once compiled: the first call per shape and config compiles, so warm up first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_M = 64
MAX_CORE_M = 16  # up to here CUDA cores (_gemv_kernel), above it tensor cores (_gemv_dot_kernel)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_BLOCK = 1024


class GemvConfig(NamedTuple):
    """Launch shape of ``gemv``; a plain 5-tuple in this order works wherever one is taken.
    ``tma`` is read by ``fused_gemv.py``'s stream GEMV only: 1 loads the weight tiles through a
    TMA descriptor, pipelined ``num_stages`` deep (see that file)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    tma: int = 0


@triton.jit
def _store_tile(
    out, ms, rows, row_mask, M, N, pid_k, bias_ptr, out_ptr, part_ptr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Both kernels' epilogue for a fp32 [BLOCK_M, BLOCK_N] tile: this split's partials, or (no
    split) plus the bias, cast and stored; rows past M and N are masked."""
    offs = ms[:, None] * N + rows[None, :]
    mask = (ms[:, None] < M) & row_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + offs, out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr,
    N, K, x_stride_m, x_stride_k,
    K_PER_SPLIT: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = tl.arange(0, BLOCK_M)
    # int64: N * K passes 2^31 for large vocabularies
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    x_rows = x_ptr + ms[:, None] * x_stride_m
    # products stay unreduced until after the loop: summing over K every step, x row by x row,
    # costs cross-lane shuffles and an x re-layout per row (sm_90 SASS: ~4 instructions per
    # product at M = 4-8, against ~2 here)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    # the same trip count in every program; steps past K (last split only) load nothing.
    # tl.range(num_stages=...) is what lets Triton pipeline loads that feed no tl.dot
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        # w: [BLOCK_N, BLOCK_K], loaded once for all M rows of x: [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x_mask = (ms[:, None] < M) & k_mask[None, :]
        x = tl.load(x_rows + ks[None, :] * x_stride_k, mask=x_mask, other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    _store_tile(out, ms, rows, row_mask, M, N, pid_k, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_BIAS)


@triton.jit
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    x_stride_m,
    x_stride_k,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The same program layout as ``_gemv_kernel`` (BLOCK_N weight rows, one K range), with the
    [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] product on tensor cores; rows past M load zeros."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    x_rows = x_ptr + ms[:, None] * x_stride_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(
            x_rows + ks[None, :] * x_stride_k, mask=(ms[:, None] < M) & k_mask[None, :], other=0.0
        )
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    _store_tile(acc, ms, rows, row_mask, M, N, pid_k, bias_ptr, out_ptr, part_ptr, SPLIT, HAS_BIAS)


@triton.jit
def _gemv_reduce_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    N,
    MN,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits every run
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_N, BLOCK_K) by padded M: 4 warps hold BLOCK_N * BLOCK_K / 128 weights per thread per
# step (32, 32, 16, 16, 8), so the unreduced accumulator (BLOCK_M times that) stays at 32-128
# fp32 registers without spills; BLOCK_N grows with M so the x tile a program loads per step
# (from L2, M rows) stays no bigger than its weight tile
_TILES = {1: (8, 512), 2: (8, 512), 4: (8, 256), 8: (16, 128), 16: (16, 64)}


def gemv_config(M: int, N: int, K: int, num_sms: int = 132) -> GemvConfig:
    """Heuristic launch shape for ``gemv`` on ``num_sms`` SMs (132: an H100 / H200).

    A decode GEMV is a weight stream: the aim is enough weight bytes in flight on every SM at a
    low instruction cost per weight. Tiles come from ``_TILES``. K is split only when the row
    blocks alone give under 2 programs per SM (too few bytes in flight), since the reduce launch
    costs a kernel boundary; then it doubles until they do, each split keeping at least one whole
    BLOCK_K. Three stages (when a program has 3+ steps) keep two tiles in flight while it
    multiplies a third.
    """
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv_config: M={M}; gemv takes 1..{MAX_M} rows")
    if M > MAX_CORE_M:
        # tensor cores, untuned: 32 x 128 weight tiles, K split only until every SM has one
        # program, since each split writes and reads back fp32 partials of M x N (at M = 64 and
        # N = 4096 a split of 8 would add half the weight's bytes again)
        block_n, block_k = 32, min(128, max(16, triton.next_power_of_2(K)))
        n_blocks, k_steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
        split_k = 1
        while n_blocks * split_k < num_sms and 2 * split_k <= k_steps:
            split_k *= 2
        steps = triton.cdiv(k_steps, split_k)
        return GemvConfig(block_n, block_k, split_k, 4, min(steps, 4))
    block_n, block_k = _TILES[triton.next_power_of_2(M)]
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    split_k = gemv_split_k(N, K, block_n, block_k, num_sms)
    steps = triton.cdiv(triton.cdiv(K, block_k), split_k)
    return GemvConfig(block_n, block_k, split_k, 4, min(steps, 3))


def gemv_split_k(N: int, K: int, block_n: int, block_k: int, num_sms: int = 132) -> int:
    """``gemv_config``'s K split for a given tile: 1 when the row blocks give 2+ programs per SM,
    else doubled until they do or a split would hold less than one BLOCK_K."""
    n_blocks, k_steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    split_k = 1
    while n_blocks * split_k < 2 * num_sms and 2 * split_k <= k_steps:
        split_k *= 2
    return split_k


def _unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        return f"x and weight must share one of {_DTYPES}, got {x.dtype} and {weight.dtype}"
    if x.device != weight.device:
        return f"x is on {x.device}, weight on {weight.device}"
    if not 1 <= x.shape[0] <= MAX_M:
        return f"x has {x.shape[0]} rows; gemv takes 1..{MAX_M}"
    if x.shape[1] != weight.shape[1] or weight.shape[0] == 0 or weight.shape[1] == 0:
        return f"shapes {tuple(x.shape)} @ {tuple(weight.shape)}.T do not match or are empty"
    if not weight.is_contiguous():
        return "weight must be contiguous [N, K] (the nn.Linear layout)"
    return None


def supports_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv(x, weight)`` runs: 2-D, one float dtype, 1 <= M <= 64, contiguous weight.
    Any N and K work (masked); x may be strided."""
    return _unsupported(x, weight) is None


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter: the count only shapes the launch
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M, K] (M <= 64) and weight [N, K]: fp32 accumulation, the
    weight read once, output [M, N] in x's dtype. ``config`` (block_n, block_k, split_k,
    num_warps, num_stages) overrides ``gemv_config``; split_k is trimmed so no split is empty.
    No host sync and no value-dependent allocation: safe to capture in a CUDA graph."""
    reason = _unsupported(x, weight)
    if reason is not None:
        raise ValueError(f"gemv: {reason}; check supports_gemv first and use F.linear otherwise")
    M, K = x.shape
    N = weight.shape[0]
    if bias is not None and (
        bias.shape != (N,) or bias.device != x.device or not bias.is_floating_point()
    ):
        raise ValueError(
            f"gemv: bias must be a float [{N}] tensor on {x.device}, "
            f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}"
        )
    cfg = GemvConfig(*config) if config is not None else gemv_config(M, N, K, _num_sms(x.device))
    if any(v < 1 or v & (v - 1) for v in (cfg.block_n, cfg.block_k)) or min(cfg[:5]) < 1:
        raise ValueError(f"gemv: {cfg} needs power-of-2 block sizes and every field >= 1")
    if M > MAX_CORE_M and min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(
            f"gemv: {cfg} at {M} rows runs on tensor cores, which need blocks of 16 or more"
        )
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bias_arg = out if bias is None else bias.contiguous()  # any pointer when there is no bias
    part = (
        out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    )
    grid = (triton.cdiv(N, cfg.block_n), split_k)
    common = dict(
        K_PER_SPLIT=k_per_split,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT=split_k > 1,
        HAS_BIAS=bias is not None,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if M > MAX_CORE_M:
        _gemv_dot_kernel[grid](
            x,
            weight,
            bias_arg,
            out,
            part,
            M,
            N,
            K,
            x.stride(0),
            x.stride(1),
            BLOCK_M=max(16, triton.next_power_of_2(M)),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            **common,
        )
    else:
        _gemv_kernel[grid](
            x,
            weight,
            bias_arg,
            out,
            part,
            N,
            K,
            x.stride(0),
            x.stride(1),
            M=M,
            BLOCK_M=triton.next_power_of_2(M),
            **common,
        )
    if split_k > 1:
        _gemv_reduce_kernel[(triton.cdiv(M * N, _REDUCE_BLOCK),)](
            part,
            bias_arg,
            out,
            N,
            M * N,
            SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
        )
    return out
