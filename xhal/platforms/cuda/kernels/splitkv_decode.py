"""Split-KV paged decode attention in one launch: the splits and their merge in the same kernel.

One program per (sequence, KV head, split) attends every query head of its GQA group (the group
padded to a 16-row tensor-core tile) over its split's share of the sequence's keys, gathered
tile by tile through the block table, with an online softmax in float32. With one split the
program writes the output itself. With several, each program writes its partial (row max, row
sum, unnormalized accumulator) to a scratch buffer and increments a counter of its (sequence, KV
head); the program that arrives last merges every split, writes the output and puts the counter
back to 0, so the next launch (and the next replay of a graph) starts from zeroed counters. No
second kernel, no host sync, nothing sized by tensor values: graph-capturable. With
``splitkv_splits.spreads`` (more splits than one merge round holds, every program resident at
once) the others wait for the last instead of leaving, and each merges a slice of the group
(``merge_slice``).

The split count is a host choice from shapes only, and the scratch is sized for it
(``splitkv_splits.py``): a graph bucket keeps both for every replay, while each program's share of
the keys is derived from the live length at run time, so one bucket serves any context.

Decode only: one query row per sequence, at position ``kv_len - 1``. Sliding window and logits
soft cap are applied in the kernel; fp16 / bf16 / fp32.

The step's own key and value can come in with the launch (``NewToken``, optionally rotated by a
``Rotary``, and before that normed per head by a ``QKNorm``, Qwen3's q_norm / k_norm): then
there is no KV-write launch (nor rotary, nor q/k-norm launch) before this one. Every program
rotates its q rows in registers; split 0 of each (sequence, KV head) rotates the new key, stores
key and value at the token's slot and seeds its online softmax with them, and no program reads
the cache at position ``kv_len - 1``, so nothing in the launch reads what it writes
(``splitkv_new_token.py``; the merge is in ``splitkv_merge.py``).

With programmatic dependent launch (sm_90, ``xhal/platforms/cuda/pdl.py``) the launch's dependent
chain starts under the kernel ahead of it (the qkv projection): before its wait a program loads
the sequence's length, its first page ids and the rotary row, and asks L2 for its split's first
``prefetch`` K / V tiles; after the wait it loads q and the new token (the projection's output)
and attends from L2. The rule that makes those early reads safe, and its argument, is pdl.py's
rule 1. ``use_pdl=pdl.OFF`` compiles the plain kernel, instruction for instruction the kernel
before PDL (checked on its sm_90 PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhal import env
from xhal.platforms.cuda import pdl
from xhal.platforms.cuda.kernels import phase_clock, splitkv_merge
from xhal.platforms.cuda.kernels.l2_prefetch import line_elements, lines, prefetch_l2
from xhal.platforms.cuda.kernels.splitkv_merge import merge, merge_slice
from xhal.platforms.cuda.kernels.splitkv_new_token import (
    NewToken,
    QKNorm,
    Rotary,
    fused_args,
    norm_args,
    rms_normed,
    rotation,
)
from xhal.platforms.cuda.kernels.splitkv_splits import (
    MERGE_FLOATS,
    Scratch,
    block_keys,
    num_splits,
    spreads,
    tile_keys,
)

__all__ = ["NewToken", "QKNorm", "Rotary", "Scratch", "block_keys", "num_splits", "splitkv_decode"]

_LOG2E = 1.4426950408889634
ROWS = 16  # query-head rows per program: the smallest tensor-core tile (tl.dot needs 16)
MAX_GROUP = ROWS
# Under PDL: the trigger (after the tile loop, not right after the wait as small kernels do) and
# the tiles of its split a program asks L2 for before its wait. H200, bf16, ctx 2K, batch 1, the
# layer's norm+qkv GEMV -> (q/k norm) -> this launch -> o GEMV in a graph (bench_splitkv --pdl,
# docs/h200-results.md, ninth session), us per layer, the plain launch / early trigger with 2
# tiles / 0 tiles / late with 2: 8B 38.9 / 39.3 / 38.2 / 38.9, MoE 33.6 / 32.2 / 32.5 / 32.3,
# 1B 22.6 / 21.1 / 21.2 / 20.6 (4 tiles at the MoE shape: 33.3). Late with 2 tiles is the one
# setting measured at every shape and never behind the plain launch.
TRIGGER = pdl.LATE
# One sequence with o beside (``env.cuda_overlap``'s ``o``): the o projection after this launch
# then takes half an SM and holds its weight slice while it waits, so the launch triggers right
# after its wait and o's CTAs land beside it. H100, batch-1 steps with every part of the overlap
# on (docs/h200-results.md, twenty-first session): 1B 1.07 against 1.14 ms with the late trigger,
# Qwen3-30B-A3B 3.31 against 3.37 (the tree before the overlap: 1.12, 3.41)
TRIGGER_BESIDE = pdl.EARLY
PREFETCH_TILES = 2
# warps a program (read per launch, so a benchmark captures other counts: at batch 1 a 16-row
# tile's softmax reduces across the warps that split its keys)
NUM_WARPS = 4
# pipeline stages of a split launch (an unsplit one takes 2; both in ``splitkv_decode``'s
# docstring). Read per launch: at batch 1 and ctx 2K every program of the MoE, 8B and 1B shapes
# has one tile, and two stages of 128-key tiles hold 72 KB of shared memory where three hold
# 136 KB, too much for o's CTA (half an SM) to land beside it (a benchmark peer tries 2)
SPLIT_STAGES = 3
# Benchmarks only (kernels/phase_clock.py): a program's row is (sequence * KV heads + KV head) *
# splits + split; "merged" only the programs that merged stamp (all of them when spread).
CLOCK: torch.Tensor | None = None
MARKS = ("start", "waited", "q ready", "new key in", "tiles done", "arrived", "merged")


def trigger(batch: int) -> int:
    """Where a launch of ``batch`` sequences under PDL lets the next kernel launch: ``TRIGGER``,
    or ``TRIGGER_BESIDE`` for one sequence with ``o`` in ``env.cuda_overlap``."""
    return TRIGGER_BESIDE if batch == 1 and "o" in env.cuda_overlap() else TRIGGER


@triton.jit
def _scores(s, scale_log2, soft_cap, SOFT_CAP: tl.constexpr):
    """Raw dot products -> scaled scores in the log2 domain, through the soft cap if any."""
    if SOFT_CAP:  # c * tanh(s / c) on the natural-log scale, tanh by exp
        s = s * (scale_log2 / 1.4426950408889634)
        s = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * s / soft_cap)) - 1.0)
        return s * 1.4426950408889634
    return s * scale_log2


@triton.jit
def _norm_weights(qw_ptr, kw_ptr, d, partner, d_mask):
    """q's and k's norm weights at each dim and at its rotary partner, in float32."""
    qw = tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    qw_partner = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    kw_partner = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    return qw, qw_partner, kw, kw_partner


@triton.jit
def _splitkv_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, kv_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, counter_ptr,
    k_new_ptr, v_new_ptr, slot_ptr, pos_ptr, rot_ptr,
    scale_log2, soft_cap, window, num_splits, max_pages,
    q_stride_b, q_stride_h, out_stride_b, out_stride_h, bt_stride_b, bt_stride_p,
    cache_stride_block, cache_stride_pos, cache_stride_head,
    k_new_stride_b, k_new_stride_h, v_new_stride_b, v_new_stride_h, rot_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr, EARLY_LOADS: tl.constexpr,
    SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr, F32_DOT: tl.constexpr,
    NEW_KV: tl.constexpr, ROTARY: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr, LINE: tl.constexpr,
    qw_ptr, kw_ptr, QK_NORM: tl.constexpr, QK_EPS: tl.constexpr,
    clock_ptr, CLOCK: tl.constexpr, epoch_ptr, SPREAD: tl.constexpr, SLICE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    program = (seq * tl.num_programs(1) + kv_head) * num_splits + split
    phase_clock.start(clock_ptr, program, 6, CLOCK)
    kv_len = tl.load(kv_lens_ptr + seq)
    lo = 0  # first visible key of the query at kv_len - 1
    if WINDOW:
        lo = tl.maximum(kv_len - window, 0)
    first = (lo // BLOCK_N) * BLOCK_N
    hi = kv_len  # keys read from the cache: [lo, hi)
    if NEW_KV:
        # split 0 owns the new token (position kv_len - 1): it writes it and starts its softmax
        # from it; the cache is read up to kv_len - 2 only, so no program reads the slot written
        hi = kv_len - 1
    # tiles are dealt round-robin (split s takes tiles s, s + splits, ...), so without a window
    # a split's first tile does not depend on kv_len; every tile dealt holds a visible key
    num_tiles = tl.where(hi > lo, tl.cdiv(hi - first, BLOCK_N), 0)
    keys = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + seq.to(tl.int64) * bt_stride_b
    # the first tile's page ids, loaded while kv_len is still in flight (within the table's
    # width; ids past the row's pages only ever address masked-off keys)
    n = first + split * BLOCK_N + keys
    page = tl.load(table_row + (n // PAGE) * bt_stride_p, mask=n // PAGE < max_pages, other=0)

    r = tl.arange(0, ROWS)
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    if USE_PDL:
        # before the wait, what the kernel ahead (the qkv projection) does not write (pdl.py,
        # rule 1): the lengths, the page ids and the rotary row above, and L2 prefetches of this
        # split's first tiles (loading nothing: L2 is coherent, so they cannot go stale)
        if ROTARY:
            rot_row = rot_ptr + tl.load(pos_ptr + seq).to(tl.int64) * rot_stride
            partner, sin, cos = rotation(rot_row, d, HALF, IS_NEOX)
        if QK_NORM:  # the norm weights: parameters, not the projection's output
            if not ROTARY:
                partner = d
            qw, qw_partner, kw, kw_partner = _norm_weights(qw_ptr, kw_ptr, d, partner, d_mask)
        line = tl.arange(0, LINES) * LINE
        for j in tl.static_range(PREFETCH):
            n_j = first + (split + j * num_splits) * BLOCK_N + keys
            if j == 0:
                page_j = page
            else:
                page_j = tl.load(table_row + (n_j // PAGE) * bt_stride_p, mask=n_j < hi, other=0)
            # keys past the split's last tile prefetch the cache's first line instead
            offs_j = tl.where(
                (n_j >= lo) & (n_j < hi),
                page_j.to(tl.int64) * cache_stride_block + (n_j % PAGE) * cache_stride_pos
                + kv_head * cache_stride_head, 0,
            )[:, None] + tl.where(line < HEAD_DIM, line, 0)[None, :]  # fmt: skip
            prefetch_l2(k_cache_ptr + offs_j)
            prefetch_l2(v_cache_ptr + offs_j)
        tl.extra.cuda.gdc_wait()  # every program waits (pdl.py, rule 2)
        phase_clock.stamp(clock_ptr, program, 1, CLOCK)
        if USE_PDL == 1:  # EARLY: the o projection's programs may start now
            tl.extra.cuda.gdc_launch_dependents()
    q_rows = q_ptr + seq.to(tl.int64) * q_stride_b + (kv_head * GROUP + r[:, None]) * q_stride_h
    q_mask = (r[:, None] < GROUP) & d_mask[None, :]
    # rows past the group are zero: their scores are 0, never stored
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    if not USE_PDL:
        if ROTARY:
            rot_row = rot_ptr + tl.load(pos_ptr + seq).to(tl.int64) * rot_stride
            partner, sin, cos = rotation(rot_row, d, HALF, IS_NEOX)
        if QK_NORM:
            if not ROTARY:
                partner = d
            qw, qw_partner, kw, kw_partner = _norm_weights(qw_ptr, kw_ptr, d, partner, d_mask)
    if ROTARY:
        q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
        if QK_NORM:  # each head normed over its D channels first (its partners by the same rms)
            q, q_partner = rms_normed(q, q_partner, qw, qw_partner, QK_EPS, HEAD_DIM, 1)
        # float32 math, rounded to q's dtype as the unfused rotary stores it
        q = (q.to(tl.float32) * cos[None, :] + q_partner.to(tl.float32) * sin[None, :]).to(
            q_ptr.dtype.element_ty
        )
    elif QK_NORM:
        q = rms_normed(q, q, qw, qw, QK_EPS, HEAD_DIM, 1)[0]
    phase_clock.stamp(clock_ptr, program, 2, CLOCK)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    if NEW_KV:
        own = (split == 0) & (kv_len > 0)
        k_row = k_new_ptr + seq.to(tl.int64) * k_new_stride_b + kv_head * k_new_stride_h
        v_row = v_new_ptr + seq.to(tl.int64) * v_new_stride_b + kv_head * v_new_stride_h
        own_d = own & d_mask
        k_new = tl.load(k_row + d, mask=own_d, other=0.0)
        v_new = tl.load(v_row + d, mask=own_d, other=0.0)
        if QK_NORM and not ROTARY:
            k_new = rms_normed(k_new, k_new, kw, kw, QK_EPS, HEAD_DIM, 0)[0]
        if ROTARY:
            k_partner = tl.load(k_row + partner, mask=own_d, other=0.0)
            if QK_NORM:
                k_new, k_partner = rms_normed(k_new, k_partner, kw, kw_partner, QK_EPS, HEAD_DIM, 0)
            k_new = (k_new.to(tl.float32) * cos + k_partner.to(tl.float32) * sin).to(
                k_cache_ptr.dtype.element_ty
            )
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + seq, mask=own, other=-1).to(tl.int64)
        if slot >= 0:  # padding tokens (slot -1) are never written
            dst = (
                (slot // PAGE) * cache_stride_block + (slot % PAGE) * cache_stride_pos
                + kv_head * cache_stride_head + d
            )  # fmt: skip
            tl.store(k_cache_ptr + dst, k_new, mask=d_mask)
            tl.store(v_cache_ptr + dst, v_new, mask=d_mask)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1)  # [ROWS]
        m_i = tl.where(own, _scores(s_new, scale_log2, soft_cap, SOFT_CAP), m_i)
        l_i = tl.where(own, 1.0, l_i)
        acc = tl.where(own, acc + v_new.to(tl.float32)[None, :], acc)
        phase_clock.stamp(clock_ptr, program, 3, CLOCK)
    if SPREAD:  # the pair's epoch before any of its programs arrives (loaded under the tiles)
        epoch = tl.load(epoch_ptr + seq * tl.num_programs(1) + kv_head, volatile=True)
    for tile in range(split, num_tiles, num_splits):
        n = first + tile * BLOCK_N + keys
        visible = (n >= lo) & (n < hi)
        offs = (
            page.to(tl.int64) * cache_stride_block + (n % PAGE) * cache_stride_pos
            + kv_head * cache_stride_head
        )  # fmt: skip
        kv_mask = visible[:, None] & d_mask[None, :]
        # masked keys load as 0: a stale slot may hold NaN, which would survive a 0 weight
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        n_next = n + num_splits * BLOCK_N  # the next tile's page ids, while this one computes
        page = tl.load(table_row + (n_next // PAGE) * bt_stride_p, mask=n_next < hi, other=0)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [ROWS, BLOCK_N]
        s = _scores(s, scale_log2, soft_cap, SOFT_CAP)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    phase_clock.stamp(clock_ptr, program, 4, CLOCK)
    if USE_PDL == 2:  # LATE: after the last K/V load, before the stores and the merge
        tl.extra.cuda.gdc_launch_dependents()

    pair = seq * tl.num_programs(1) + kv_head
    if NEW_KV:  # split 0 holds the new token even when no tile is dealt
        live = tl.minimum(num_splits, tl.maximum(num_tiles, 1))
    else:
        live = tl.minimum(num_splits, num_tiles)
    if num_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * out_stride_b
            + (kv_head * GROUP + r[:, None]) * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=(r[:, None] < GROUP) & d_mask[None, :],
        )  # fmt: skip
        phase_clock.stamp(clock_ptr, program, 5, CLOCK)
    else:
        part = pair.to(tl.int64) * num_splits + split
        tl.store(part_max_ptr + part * GROUP + r, m_i, mask=r < GROUP)
        tl.store(part_sum_ptr + part * GROUP + r, l_i, mask=r < GROUP)
        tl.store(
            part_acc_ptr + (part * GROUP + r[:, None]) * HEAD_DIM + d[None, :], acc,
            mask=(r[:, None] < GROUP) & d_mask[None, :],
        )  # fmt: skip
        # every thread's partial stores happen before the one thread's release below
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pair, 1, sem="acq_rel", scope="gpu")
        phase_clock.stamp(clock_ptr, program, 5, CLOCK)
        if SPREAD:  # every program merges its slice once the last has arrived
            if arrived == num_splits - 1:  # the last: counter back to 0, the others let go
                tl.atomic_xchg(counter_ptr + pair, 0, sem="relaxed", scope="gpu")
                tl.atomic_add(epoch_ptr + pair, 1, sem="release", scope="gpu")
            else:  # acquire: once the epoch moves, every split's partial is visible
                seen = epoch
                while seen == epoch:
                    seen = tl.atomic_add(epoch_ptr + pair, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()  # the one thread's acquire before every thread's loads
            merge_slice(
                part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
                pair.to(tl.int64) * num_splits, live,
                seq.to(tl.int64) * out_stride_b + kv_head * GROUP * out_stride_h, out_stride_h,
                split, GROUP, HEAD_DIM, SPLITS_PAD, SLICE,
            )  # fmt: skip
            phase_clock.stamp(clock_ptr, program, 6, CLOCK)
        elif arrived == num_splits - 1:  # the last split of this (sequence, KV head): merge
            tl.atomic_xchg(counter_ptr + pair, 0, sem="relaxed", scope="gpu")
            merge(
                part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
                pair.to(tl.int64) * num_splits, live,
                seq.to(tl.int64) * out_stride_b + kv_head * GROUP * out_stride_h, out_stride_h,
                GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD, SPLITS_PAD, MERGE_CHUNK, EARLY_LOADS,
            )  # fmt: skip
            phase_clock.stamp(clock_ptr, program, 6, CLOCK)


def splitkv_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    scratch: Scratch,
    splits: int,
    scale: float,
    soft_cap: float = 0.0,
    window: int = 0,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_n: int | None = None,
    new: NewToken | None = None,
    rotary: Rotary | None = None,
    qk_norm: QKNorm | None = None,
    use_pdl: int | None = None,
    prefetch: int = PREFETCH_TILES,
) -> torch.Tensor:
    """One query row per sequence: q ``[B, H, D]`` (strides free but the last), caches
    ``[num_blocks, block_size, Hkv, D]``, block_table int32 ``[B, max_pages]`` (strides free),
    kv_lens int32 ``[B]`` including this step's key; writes out ``[B, H, D]``. ``scratch``:
    made for at least B sequences and ``splits`` splits. ``window`` > 0: the query sees
    its last ``window`` keys; ``soft_cap`` > 0: scores go through ``c * tanh(s / c)``.
    ``num_warps`` (default ``NUM_WARPS``), ``num_stages``, ``block_n`` (keys per tile,
    default ``tile_keys``): the launch shape, for sweeps.
    Stages by default: three for a split launch, two unsplit. On the H200 (bf16, ctx 2K, per
    layer) three stages beat two split (32 q / 8 kv heads D=128: 11.2 against 12.0 us at batch 1,
    16 splits; 48.1 against 49.0 at batch 16) and lost unsplit (batch 64: 156 against 131 us;
    32 / 4 heads 91.3 against 76.5; D=64 85.9 against 74.6), where the third 32 KB stage of
    shared memory leaves fewer programs per SM.

    ``new``: the step's key and value come with the launch and are written by it (no KV write
    before); ``rotary`` (with ``new`` only): q and the new key are rotated first, q given
    unrotated; ``qk_norm`` (with ``new`` only): q and the new key are normed per head before
    that, q given unnormed (Qwen3's q_norm / k_norm: no ``qk_rms_norm`` launch before).

    ``use_pdl``: ``pdl.OFF`` (the plain kernel), ``pdl.EARLY`` (trigger right after the wait) or
    ``pdl.LATE`` (after the last K/V load); by default ``trigger(batch)`` where ``pdl.mode`` is
    on.
    Under PDL a program loads the lengths, page ids and rotary row and asks L2 for ``prefetch``
    tiles of its split before waiting for the kernel ahead (pdl.py, rule 1), so that dependent
    chain runs under that kernel's tail."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if group > MAX_GROUP or num_heads % num_kv_heads:
        raise ValueError(
            f"split-KV decode takes GQA groups up to {MAX_GROUP}, got {num_heads} heads over "
            f"{num_kv_heads} KV heads; use the paged attention kernel"
        )
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("split-KV decode needs a contiguous last dimension of q, out and caches")
    if v_cache.stride() != k_cache.stride():
        raise ValueError("split-KV decode needs the key and value caches in the same layout")
    if splits < 1 or not scratch.fits(batch, num_kv_heads, splits):
        raise ValueError(
            f"scratch too small for {batch} sequences x {num_kv_heads} KV heads x {splits} splits"
        )
    if rotary is not None and new is None:
        raise ValueError("split-KV decode rotates q only with the new token (pass new=NewToken)")
    if num_stages is None:
        num_stages = SPLIT_STAGES if splits > 1 else 2
    new_args, rot_args, half, is_neox = fused_args(q, k_cache, new, rotary)
    qk_args = norm_args(q, new, qk_norm)
    if use_pdl is None:
        use_pdl = trigger(batch) if pdl.mode(q.device) else pdl.OFF
    use_pdl = int(use_pdl)
    if use_pdl not in (pdl.OFF, pdl.EARLY, pdl.LATE) or prefetch < 0:
        raise ValueError(
            f"split-KV decode: use_pdl must be pdl.OFF, EARLY or LATE (got {use_pdl}) and "
            f"prefetch >= 0 tiles (got {prefetch})"
        )
    dim_pad = max(triton.next_power_of_2(head_dim), 16)
    group_pad = triton.next_power_of_2(group)
    splits_pad = triton.next_power_of_2(splits)
    merge_chunk = max(1, min(splits_pad, MERGE_FLOATS // (group_pad * dim_pad)))
    programs = batch * num_kv_heads * splits
    spread = spreads(batch * num_kv_heads, group, head_dim, splits, q.device)
    # fp32 products in IEEE precision for fp32 (not TF32), and for bf16 in Triton's interpreter
    # (CPU tensors), whose bf16 tl.dot multiplies wrong (Triton 3.6); compiled bf16 / fp16 run
    # on tensor cores with float32 accumulation
    f32_dot = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type != "cuda")
    _splitkv_decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, out, block_table, kv_lens,
        scratch.part_acc, scratch.part_max, scratch.part_sum, scratch.counters,
        *new_args[:3], *rot_args[:2],
        scale * _LOG2E, float(soft_cap), int(window), splits, block_table.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), block_table.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *new_args[3:], rot_args[2],
        GROUP=group, GROUP_PAD=group_pad, ROWS=ROWS, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        PAGE=page, SPLITS_PAD=splits_pad,
        BLOCK_N=block_n or tile_keys(head_dim, k_cache.element_size(), programs, q.device),
        MERGE_CHUNK=merge_chunk, EARLY_LOADS=splitkv_merge.EARLY_LOADS,
        SOFT_CAP=soft_cap > 0, WINDOW=window > 0, F32_DOT=f32_dot,
        NEW_KV=new is not None, ROTARY=rotary is not None, HALF=half, IS_NEOX=is_neox,
        USE_PDL=use_pdl, PREFETCH=prefetch if use_pdl else 0,
        LINES=lines(head_dim * k_cache.element_size()),
        LINE=line_elements(k_cache.element_size()),
        clock_ptr=CLOCK, CLOCK=CLOCK is not None,
        epoch_ptr=scratch.epochs if spread else None, SPREAD=spread,
        SLICE=triton.next_power_of_2(-(-group * head_dim // splits)) if spread else 1,
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages, **qk_args,
        **pdl.launch_options(use_pdl),
    )  # fmt: skip
    return out
