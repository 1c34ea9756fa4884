"""Fused mixture of experts in Triton: the routed experts as two grouped GEMMs over token-expert
pairs sorted by expert (a few tokens take the pair GEMVs of ``moe_small`` instead: no sort, no
padding). The routing that picks the pairs is ``moe_route.py``.

The pairs (token t, its j-th expert) are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M``, so that every block of ``BLOCK_M`` sorted rows belongs to one expert and a
program multiplies them by that expert's weights alone. Everything is sized by host-known
bounds (the number of pairs, the number of experts), never by the routing's values: no host
sync, so a decode step captures into a CUDA graph and replays with any routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda.kernels.moe_small import SmallMoeConfig, small_experts, use_small_path


@dataclass(frozen=True)
class SortedPairs:
    """Token-expert pairs sorted by expert, each expert's run padded to ``block_m`` rows.

    ``pair_ids [R]``: the pair (``t * k + j``) of each sorted row, ``num_pairs`` on padding rows;
    ``block_expert [R / block_m]``: each block's expert, ``num_experts`` for blocks past the last
    expert's run (their programs exit at once, so their rows are never read and left undefined).
    ``R`` is a bound known on the host.
    """

    pair_ids: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int


def _num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    # at most min(E, P) experts are non-empty, each padded by fewer than block_m rows
    return max(1, triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m))


def sort_pairs_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """``SortedPairs`` by torch ops (a stable sort): any number of pairs."""
    flat = topk_ids.reshape(-1).long()  # [P]: pair t * k + j -> its expert
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would size by a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    row = (padded_end - padded)[expert_of_sorted] + rank
    num_blocks = _num_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, row, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return SortedPairs(pair_ids, block_expert, num_pairs, block_m)


@triton.jit(do_not_specialize=["num_pairs"])
def _sort_pairs_kernel(
    ids_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    P_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    NB_BLOCK: tl.constexpr,
):
    # one program per expert: every program counts all pairs per expert (a histogram), finds
    # where its expert's padded run starts, and writes its pairs there in their original order
    expert = tl.program_id(0)
    offs = tl.arange(0, P_BLOCK)
    valid = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=E_BLOCK)  # lanes past P land in a spare bin
    bins = tl.arange(0, 2 * E_BLOCK)
    counts = tl.where(bins < NUM_EXPERTS, tl.histogram(ids, 2 * E_BLOCK), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    start = tl.sum(tl.where(bins == expert, starts, 0), axis=0)
    count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    run = tl.sum(tl.where(bins == expert, padded, 0), axis=0)
    hit = valid & (ids == expert)
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    tl.store(pair_ids_ptr + start + rank, offs.to(tl.int32), mask=hit)
    pad = tl.arange(0, BLOCK_M)
    tl.store(
        pair_ids_ptr + start + count + pad,
        (pad * 0 + num_pairs).to(tl.int32),
        mask=pad < run - count,
    )
    blocks = tl.arange(0, NB_BLOCK)
    first = start // BLOCK_M
    mine = (blocks >= first) & (blocks < first + run // BLOCK_M)
    tl.store(block_expert_ptr + blocks, (blocks * 0 + expert).to(tl.int32), mask=mine)
    # blocks past the last run: marked empty (their rows are never read)
    total = tl.sum(padded, axis=0) // BLOCK_M
    tail = (blocks >= total) & (blocks < NUM_BLOCKS) & (expert == 0)
    tl.store(block_expert_ptr + blocks, (blocks * 0 + NUM_EXPERTS).to(tl.int32), mask=tail)


MAX_FUSED_SORT_PAIRS = 4096  # one program holds every pair: decode batches, not long prefills


def sort_pairs_fused(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """``SortedPairs`` in one launch (decode-sized batches: up to ``MAX_FUSED_SORT_PAIRS``)."""
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32 or not flat.is_contiguous():
        flat = flat.to(torch.int32).contiguous()
    num_pairs = flat.numel()
    if num_pairs > MAX_FUSED_SORT_PAIRS:
        raise ValueError(
            f"sort_pairs_fused takes up to {MAX_FUSED_SORT_PAIRS} pairs, got {num_pairs}"
        )
    num_blocks = _num_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    _sort_pairs_kernel[(num_experts,)](
        flat,
        pair_ids,
        block_expert,
        num_pairs,
        NUM_EXPERTS=num_experts,
        NUM_BLOCKS=num_blocks,
        BLOCK_M=block_m,
        P_BLOCK=max(16, triton.next_power_of_2(num_pairs)),
        E_BLOCK=triton.next_power_of_2(num_experts),
        NB_BLOCK=triton.next_power_of_2(num_blocks),
    )
    return SortedPairs(pair_ids, block_expert, num_pairs, block_m)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """Token-expert pairs sorted by expert and padded per expert to ``block_m`` rows: one launch
    for decode-sized batches, torch's stable sort beyond."""
    if topk_ids.numel() <= MAX_FUSED_SORT_PAIRS:
        return sort_pairs_fused(topk_ids, num_experts, block_m)
    return sort_pairs_torch(topk_ids, num_experts, block_m)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    a_stride,
    b_stride_e,
    b_stride_n,
    c_stride,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    APPLY_WEIGHTS: tl.constexpr,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # c[pair] = a[pair // PAIRS_PER_ROW] @ b[expert].T (* weights[pair]) for the block's rows;
    # GATED: b's rows are N gate rows then N up rows, and c = silu(a @ gate.T) * (a @ up.T)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    a_rows = pairs // PAIRS_PER_ROW
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * b_stride_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * a_stride + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(  # [BLOCK_K, BLOCK_N]: rows of the expert's [N, K] weight, transposed
            b_base + offs_n[None, :] * b_stride_n + offs_k[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            up = tl.load(
                b_base + (offs_n[None, :] + N) * b_stride_n + offs_k[:, None],
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            up_acc = tl.dot(a, up, up_acc, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * up_acc
    if APPLY_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + pairs[:, None] * c_stride + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def default_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """The M tile follows the rows an expert gets on average, since every expert's run is padded
    to it: decode batches (a few rows per expert, even at batch 64 over 128 experts) take the
    smallest tile and narrow N tiles for more programs over the weights; prefill fills larger."""
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 16:
        return MoeConfig(block_m=16, block_n=32, block_k=128)
    if rows_per_expert <= 48:
        return MoeConfig(block_m=32, block_n=64, block_k=64)
    return MoeConfig(block_m=64, block_n=64, block_k=64, num_stages=3)


def _grouped_gemm(
    a,
    b,
    out,
    sorted_pairs: SortedPairs,
    pairs_per_row: int,
    weights,
    config: MoeConfig,
    gated: bool = False,
) -> None:
    num_experts, n, k = b.shape
    n = n // 2 if gated else n
    grid = (sorted_pairs.block_expert.numel(), triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        sorted_pairs.pair_ids,
        sorted_pairs.block_expert,
        weights if weights is not None else out,
        sorted_pairs.num_pairs,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        N=n,
        K=k,
        NUM_EXPERTS=num_experts,
        PAIRS_PER_ROW=pairs_per_row,
        # float32 stays float32 ("ieee": no TF32 rounding); 16-bit inputs ignore the setting
        APPLY_WEIGHTS=weights is not None,
        GATED=gated,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


@triton.jit
def _combine_kernel(
    down_ptr,
    out_ptr,
    out_stride,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out[t] = sum_j down[t * k + j] in float32, in a fixed order, cast once: one launch where a
    # torch sum and a dtype copy took two
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(down_ptr + (token * TOP_K + j) * HIDDEN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + token * out_stride + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_COMBINE_BLOCK = 1024


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | SmallMoeConfig | None = None,
) -> torch.Tensor:
    """``DeviceOps.moe_experts``. For a few tokens (``moe_small.use_small_path``: shapes only, so
    a graph bucket's constant) the pair GEMVs of ``moe_small``; beyond, the gate-up GEMM with
    SiLU-and-multiply in its epilogue, the down GEMM scaled by each pair's routing weight, then
    each token's k rows summed in float32. A config forces its path (benchmarks, tests)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    num_pairs = num_tokens * top_k
    if isinstance(config, SmallMoeConfig) or (
        config is None and use_small_path(num_tokens, top_k, num_experts)
    ):
        return small_experts(x, w13, w2, topk_weights, topk_ids, config)
    config = config or default_config(num_pairs, num_experts)
    pairs = sort_pairs(topk_ids, num_experts, config.block_m)
    act = x.new_empty(num_pairs, two_inter // 2)  # [P, I]
    _grouped_gemm(x, w13, act, pairs, top_k, None, config, gated=True)
    down = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    _grouped_gemm(act, w2, down, pairs, 1, topk_weights.reshape(-1).float().contiguous(), config)
    out = x.new_empty(num_tokens, hidden)
    if num_tokens:
        _combine_kernel[(num_tokens, triton.cdiv(hidden, _COMBINE_BLOCK))](
            down,
            out,
            out.stride(0),
            HIDDEN=hidden,
            TOP_K=top_k,
            BLOCK=_COMBINE_BLOCK,
        )
    return out
