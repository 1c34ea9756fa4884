"""A decode token's routed experts (``DeviceOps.moe_experts`` for one token) in one persistent
launch: ``moe_block.cu`` (what it computes and how), built by ``native.py``.

Why one launch: at batch 1 the Qwen3-30B-A3B shape's experts stream 75.5 MB a layer (8 experts'
gate, up and down rows), and moe_small's two Triton pair GEMVs (gate-up, down + combine) plus
the router ahead of them took 28.2 us a layer against 18-19 us of floor on the H200
(docs/h200-results.md, eleventh session): each launch's ramp and tail, and the one tile a Triton
program keeps in flight. Here one CTA per SM keeps several stages of expert rows in flight
through TMA bulk copies from the moment the routing is read to the last down row, across the
grid barrier between the two projections.

Measured (H100, Qwen3-30B-A3B shape, docs/h200-results.md, seventeenth session): router + experts
36.5 us a layer against 35.1 with the pair GEMVs, the decode step 3.47 against 3.41 ms. Unlike the
dense MLP block, no weight here is known before the wait for the router, so the stream starts
only after it (4 us into the launch), and the grid barrier passed 3.8 us after its last arrival
(the phase clock, ``benchmarks/check_moe_small.py``), where phase 1 itself streamed at 0.91 of
the read ceiling. Hence the ``native`` solution is registered below ``triton``
(``XHAL_KERNEL_MOE_EXPERTS=native`` picks it). The eighteenth session measured both ideas for
that barrier (docs/h200-results.md): requesting the down stages after it (``late_down``) made
the chain slower (37.7 against 36.6 us a layer), and a version without any grid barrier (counts
of each expert's finished units, a watcher warp; not kept, the section describes it) streamed
the whole 75.5 MB at 0.88 of the ceiling once the routing was read, and took 37.6 us a layer.

Shapes it takes (``plan``): one token, fp16 / bf16, hidden and intermediate sizes multiples of 8
whose stages fit in shared memory at least two deep; sm_90+.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from xhal.platforms.cuda import native

SOURCE = Path(__file__).with_name("moe_block.cu")
THREADS = 256
_WARPS = THREADS // 32
_MAX_STAGES = 8
# a phase-2 stage's bytes at most (DOWN_ROWS rows of w2): each stage costs a CTA one wait and
# one block-wide barrier, so the stage is as wide as this allows while every CTA still gets a
# row block of its own
_MAX_STAGE2_BYTES = 32 * 1024


@dataclass(frozen=True)
class Plan:
    """A shape's stage layout: gate/up row pairs per phase-1 stage, w2 rows per phase-2 stage,
    how many stages of each the ring holds, and the shared memory in all (bytes)."""

    pairs: int
    down_rows: int
    stages1: int
    stages2: int
    shared_mem: int


def _down_rows(hidden: int, inter: int, num_sms: int) -> int:
    """The widest phase-2 stage (rows of w2) within ``_MAX_STAGE2_BYTES`` that still leaves
    every CTA a row block: the combine sums a row block's experts in one CTA, so the row blocks
    are the phase's units."""
    for rows in (16, 8, 4, 2, 1):
        fits = rows * inter * 2 <= _MAX_STAGE2_BYTES
        if hidden % rows == 0 and fits and hidden // rows >= num_sms:
            return rows
    return 1


def fixed_bytes(pairs: int, down_rows: int, inter: int, top_k: int) -> int:
    """Shared memory besides the ring and the mbarriers (the kernel's layout): act, two buffers
    of per-warp partial sums, the routing weights and ids, and the 8-byte alignment after them."""
    parts = 2 * _WARPS * max(2 * pairs, down_rows) * 4
    return top_k * inter * 2 + parts + 8 * top_k + 8


@functools.cache
def plan(
    hidden: int,
    inter: int,
    top_k: int,
    max_shared_mem: int,
    num_sms: int,
    pairs: int | None = None,
    down_rows: int | None = None,
) -> Plan | None:
    """The widest stages that fit at least three deep (two for the widest models), or None.
    ``pairs`` and ``down_rows`` force those stage widths (a benchmark's other layouts)."""
    if hidden % 8 or inter % 8 or not 1 <= top_k <= THREADS:
        return None
    down_rows = down_rows or _down_rows(hidden, inter, num_sms)
    if hidden % down_rows:
        return None
    for depth in (3, 2):
        for p in (pairs,) if pairs else (4, 2, 1):
            if inter % p:
                continue
            stage1, stage2 = 2 * p * hidden * 2, down_rows * inter * 2
            fixed = fixed_bytes(p, down_rows, inter, top_k)
            fit = native.ring_stages(max_shared_mem, fixed, stage1, stage2, depth, _MAX_STAGES)
            if fit is not None:
                return Plan(p, down_rows, *fit)
    return None


def supports(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> bool:
    """Whether the persistent launch takes these operands (the caller falls back otherwise)."""
    if not native.takes_rows(x, 1):
        return False
    if w13.dim() != 3 or w2.dim() != 3:
        return False
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if x.shape[1] != hidden or w2.shape != (num_experts, hidden, inter) or two_inter != 2 * inter:
        return False
    if any(t.dtype != x.dtype or t.device != x.device for t in (w13, w2)):
        return False
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        return False
    if topk_ids.dim() != 2 or topk_ids.shape[0] != 1 or topk_weights.shape != topk_ids.shape:
        return False
    if not all(t.is_contiguous() for t in (w13, w2, topk_weights, topk_ids)):
        return False
    if not native.chunk_aligned((x,), (w13, w2)):
        return False
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return plan(hidden, inter, topk_ids.shape[1], native.max_shared_mem(x.device), sms) is not None


class MoeBlock:
    """The launches of one device: its kernels by shape, and the two sync words every launch of
    the device shares (launches are stream-ordered: one stream at a time uses them)."""

    # the phase boundaries a TIMING build marks (benchmarks/check_moe_small.py prints them)
    MARKS = ("start", "routing read", "phase 1 done", "barrier passed", "act loaded", "end")

    def __init__(
        self,
        device: torch.device,
        plan_for=plan,
        timing: torch.Tensor | None = None,
        late_down: bool = False,
    ) -> None:
        """``plan_for(hidden, inter, top_k, max_shared_mem, num_sms)`` picks each shape's stages
        (``plan``; a benchmark may pass its own to compare layouts). ``timing`` (int64 ``[SMs,
        8]``, benchmarks only): each CTA's ``%globaltimer`` at ``MARKS``, the kernel built with
        ``TIMING``. ``late_down`` (benchmarks only): the first down stages requested after the
        grid barrier instead of before it."""
        self._kernels = native.KernelCache(SOURCE, "moe_block", device)
        self._plan_for = plan_for
        self.timing, self.late_down = timing, late_down
        self.sync = torch.zeros(2, dtype=torch.int32, device=device)

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        use_pdl: bool,
    ) -> torch.Tensor:
        """``out [1, H]``; ``supports`` said yes for these operands."""
        _, two_inter, hidden = w13.shape
        inter, top_k = two_inter // 2, topk_ids.shape[1]
        k = self._kernels
        p = self._plan_for(hidden, inter, top_k, k.max_shared_mem, k.num_sms)
        defines = {
            "DTYPE_BF16": int(x.dtype == torch.bfloat16), "HIDDEN": hidden, "INTER": inter,
            "TOP_K": top_k, "PAIRS": p.pairs, "DOWN_ROWS": p.down_rows, "STAGES1": p.stages1,
            "STAGES2": p.stages2, "USE_PDL": int(use_pdl), "TIMING": int(self.timing is not None),
            "LATE_DOWN": int(self.late_down),
        }  # fmt: skip
        kernel = k.get(defines, p.shared_mem)
        out = x.new_empty(1, hidden)
        act = x.new_empty(top_k, inter)
        tensors = (x, w13, w2, topk_weights, topk_ids, out, act, self.sync)
        args = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
        args.append(ctypes.c_longlong(x.stride(0)))
        args.append(ctypes.c_void_p(0 if self.timing is None else self.timing.data_ptr()))
        kernel.launch(k.num_sms, THREADS, args, use_pdl)
        return out
