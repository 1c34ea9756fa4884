"""The merge of the split-KV decode launch (``splitkv_decode.py``): the program that arrives
last for a (sequence, KV head) combines every split's partial (row max, row sum, unnormalized
accumulator) into the output, in rounds of ``MERGE_CHUNK`` splits. Built with ``EARLY_LOADS`` it
computes the same in the same order with its loads issued ahead: the first round's with the row
maxes and sums, each later round's while the round before it is summed (benchmarks compare the
two).

Spread (``splitkv_splits.spreads``), every program of the pair merges a slice of the group's
outputs once the last has arrived (``merge_slice``): one round of a few KB each, where the last
program alone loads every split's partial."""

from __future__ import annotations

import triton
import triton.language as tl

# the merge the split-KV launch builds (read per launch, so a benchmark captures both)
EARLY_LOADS = False


@triton.jit
def _chunk(part_acc_ptr, part_max_ptr, first_part, live_splits, c, g, d, g_mask,
           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_CHUNK: tl.constexpr):  # fmt: skip
    """One round's loads: its splits' row maxes [MERGE_CHUNK, GROUP_PAD] and accumulators
    [MERGE_CHUNK, GROUP_PAD, DIM_PAD], from L2 (.cg: never a stale L1 line)."""
    sc = c + tl.arange(0, MERGE_CHUNK)
    c_rows = (first_part + sc[:, None]) * GROUP + g[None, :]
    c_mask = (sc[:, None] < live_splits) & g_mask[None, :]  # splits past the tiles hold nothing
    c_max = tl.load(part_max_ptr + c_rows, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(
        part_acc_ptr + c_rows[:, :, None] * HEAD_DIM + d[None, None, :],
        mask=c_mask[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0, cache_modifier=".cg",
    )  # fmt: skip
    return c_max, part


@triton.jit
def merge(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, first_part, live_splits, out_offset,
    out_stride_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr, EARLY_LOADS: tl.constexpr,
):
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_mask = g < GROUP
    sp = tl.arange(0, SPLITS_PAD)
    rows = (first_part + sp[:, None]) * GROUP + g[None, :]  # [SPLITS_PAD, GROUP_PAD]
    mask = (sp[:, None] < live_splits) & g_mask[None, :]  # splits past the tiles hold nothing
    # .cg: read from L2, where the other programs' stores are; never a stale L1 line
    maxes = tl.load(part_max_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
    sums = tl.load(part_sum_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
    if EARLY_LOADS:  # the first round's loads before the first reduction
        c_max, part = _chunk(part_acc_ptr, part_max_ptr, first_part, live_splits, 0, g, d, g_mask,
                             GROUP, HEAD_DIM, MERGE_CHUNK)  # fmt: skip
    top = tl.max(maxes, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no visible key at all: weights 0, output 0
    total = tl.sum(tl.exp2(maxes - top[None, :]) * sums, axis=0)  # [GROUP_PAD]
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for c in tl.static_range(0, SPLITS_PAD, MERGE_CHUNK):
        if EARLY_LOADS:
            if c + MERGE_CHUNK < SPLITS_PAD:  # the next round's loads before this round's sums
                next_max, next_part = _chunk(part_acc_ptr, part_max_ptr, first_part, live_splits,
                                             c + MERGE_CHUNK, g, d, g_mask, GROUP, HEAD_DIM,
                                             MERGE_CHUNK)  # fmt: skip
            acc += tl.sum(tl.exp2(c_max - top[None, :])[:, :, None] * part, axis=0)
            if c + MERGE_CHUNK < SPLITS_PAD:
                c_max, part = next_max, next_part
        else:  # the order the merge had before EARLY_LOADS, kept instruction for instruction:
            # each round's maxes, their weights, then its accumulators
            sc = c + tl.arange(0, MERGE_CHUNK)
            c_rows = (first_part + sc[:, None]) * GROUP + g[None, :]  # [MERGE_CHUNK, GROUP_PAD]
            c_mask = (sc[:, None] < live_splits) & g_mask[None, :]
            c_max = tl.load(part_max_ptr + c_rows, mask=c_mask, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
            weight = tl.exp2(c_max - top[None, :])
            part = tl.load(
                part_acc_ptr + c_rows[:, :, None] * HEAD_DIM + d[None, None, :],
                mask=c_mask[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0,
                cache_modifier=".cg",
            )  # fmt: skip
            acc += tl.sum(weight[:, :, None] * part, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + out_offset + g[:, None] * out_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & (d < HEAD_DIM)[None, :],
    )


@triton.jit
def merge_slice(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, first_part, live_splits, out_offset,
    out_stride_h, slice_index,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SLICE: tl.constexpr,
):
    """Outputs ``slice_index * SLICE`` to ``(slice_index + 1) * SLICE - 1`` of the group's
    ``GROUP * HEAD_DIM`` (row-major: query row, then dim) from every split's partial, in one
    round: the rows' maxes and sums [SPLITS_PAD, SLICE] (repeated along a row's dims) and the
    accumulators' slice."""
    e = slice_index * SLICE + tl.arange(0, SLICE)
    e_mask = e < GROUP * HEAD_DIM
    g = e // HEAD_DIM
    d = e % HEAD_DIM
    sp = tl.arange(0, SPLITS_PAD)
    rows = (first_part + sp[:, None]) * GROUP + g[None, :]  # [SPLITS_PAD, SLICE]
    mask = (sp[:, None] < live_splits) & e_mask[None, :]  # splits past the tiles hold nothing
    # .cg: read from L2, where the other programs' stores are; never a stale L1 line
    maxes = tl.load(part_max_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
    sums = tl.load(part_sum_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
    part = tl.load(part_acc_ptr + rows * HEAD_DIM + d[None, :], mask=mask, other=0.0,
                   cache_modifier=".cg")  # fmt: skip
    top = tl.max(maxes, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no visible key at all: weights 0, output 0
    weight = tl.exp2(maxes - top[None, :])
    total = tl.sum(weight * sums, axis=0)
    out = tl.sum(weight * part, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + out_offset + g * out_stride_h + d, out.to(out_ptr.dtype.element_ty),
             mask=e_mask)  # fmt: skip
