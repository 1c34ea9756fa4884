"""The gated MLP block of a decode step (residual add, RMSNorm, gate_up, SiLU gate, down) in one
persistent launch: ``mlp_block.cu`` (what it computes and how), built by ``native.py``.

Why one launch: at batch 1 the two fused GEMVs it replaces (norm + gate_up, SiLU + down) stream
their weights at 0.67-0.72 of the read ceiling at the Llama-3.2-1B shape (21.7 + 11.7 us for
100 MB; docs/h200-results.md, ninth session); what they lose is each kernel's ramp and tail and the
one tile a Triton program keeps in flight. Here one CTA per SM keeps several 16-56 KB stages of
weight rows in flight through TMA bulk copies the whole time, across the wait for the kernel ahead
and across the grid barrier between the two projections.

Shapes it takes (``plan``): 1 to ``MAX_ROWS`` rows, fp16 / bf16, hidden and intermediate sizes
multiples of 8 whose stages fit in shared memory at least two deep; sm_90+.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from xhal.platforms.cuda import native

SOURCE = Path(__file__).with_name("mlp_block.cu")
MAX_ROWS = 4
# the rows CudaOps sends here: one. At 2 and 4 rows the Llama-3.2-1B step was 1.14 / 1.36 ms
# with the block against 1.13 / 1.19 ms on the tree's path (norm and activation kernels around
# cuBLAS) in one process (H200, docs/h200-results.md, fourteenth session); the block's per-stage
# reductions grow with the rows while cuBLAS's tensor cores take them for free
ROUTED_ROWS = 1
THREADS = 256
_WARPS = THREADS // 32
_MAX_STAGES = 8
# Under env.cuda_overlap the block runs in half an SM only where its widest stages fit there at
# least this deep in both phases; it keeps the whole SM otherwise. H100, batch-1 steps, each
# setting's graphs in one process (docs/h200-results.md, twenty-first session): the 1B shape's
# half-SM plan (3 x 32 KB stages a phase) with the other parts made the step 1.07 ms against the
# tree's 1.12; the 8B's (2 x 32 KB gate/up stages) made it 5.98 against 5.66 ms with every part
# on, 5.68 with the attention's early trigger too, and the other parts without it 5.56-5.58
BESIDE_DEPTH = 3


@dataclass(frozen=True)
class Plan:
    """A shape's stage layout: gate/up row pairs per phase-1 stage, w_down rows per phase-2
    stage, how many stages of each the ring holds, and the shared memory in all (bytes)."""

    pairs: int
    down_rows: int
    stages1: int
    stages2: int
    shared_mem: int


@functools.cache
def plan(
    hidden: int, inter: int, rows: int, max_shared_mem: int, widest: bool = False
) -> Plan | None:
    """The widest stages that fit at least three deep (two for the widest models), or None;
    ``widest``: the widest stages that fit at least two deep, before any depth (what a ring in
    half an SM takes, ``native.beside_share``: a CTA's work per stage is what bounds narrow
    stages). The layout of the shared memory is the kernel's: ring, act, parts, norm sums,
    mbarriers."""
    if hidden % 8 or inter % 8 or not 1 <= rows <= MAX_ROWS:
        return None
    widths = [(pairs, down_rows) for pairs in (4, 2, 1) for down_rows in (2, 1)]
    order = (
        [(depth, *w) for w in widths for depth in (3, 2)]
        if widest
        else [(depth, *w) for depth in (3, 2) for w in widths]
    )
    for depth, pairs, down_rows in order:
        if inter % pairs or hidden % down_rows:
            continue
        stage1, stage2 = 2 * pairs * hidden * 2, down_rows * inter * 2
        fixed = rows * inter * 2 + 4 * (2 * _WARPS * 2 * pairs * rows + _WARPS * rows)
        fit = native.ring_stages(max_shared_mem, fixed, stage1, stage2, depth, _MAX_STAGES)
        if fit is not None:
            return Plan(pairs, down_rows, *fit)
    return None


def beside_plan(hidden: int, inter: int, rows: int, max_shared_mem: int) -> Plan | None:
    """``plan`` in the half of an SM ``native.beside_share`` leaves (``env.cuda_overlap``), the
    widest stages first; None where it keeps a phase's ring under ``BESIDE_DEPTH`` stages."""
    p = plan(hidden, inter, rows, native.beside_share(max_shared_mem), widest=True)
    if p is None or min(p.stages1, p.stages2) < BESIDE_DEPTH:
        return None
    return p


def supports(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> bool:
    """Whether the persistent launch takes these operands (the caller falls back otherwise)."""
    if not native.takes_rows(x, MAX_ROWS):
        return False
    hidden, inter = x.shape[1], w_down.shape[1]
    tensors = (x, residual, norm_weight, w_gate_up, w_down)
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return False
    if residual.shape != x.shape or norm_weight.shape != (hidden,):
        return False
    if w_gate_up.shape != (2 * inter, hidden):
        return False
    if w_down.shape != (hidden, inter):
        return False
    if not all(t.is_contiguous() for t in (norm_weight, w_gate_up, w_down)):
        return False
    if not native.chunk_aligned((x, residual), tensors):
        return False
    return plan(hidden, inter, x.shape[0], native.max_shared_mem(x.device)) is not None


def fits_beside(x: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether operands ``supports`` takes also run in half an SM (``beside_plan``; what fits
    there fits the whole SM, so nothing ``supports`` checked is asked again)."""
    budget = native.max_shared_mem(x.device)
    return beside_plan(x.shape[1], w_down.shape[1], x.shape[0], budget) is not None


class MlpBlock:
    """The launches of one device: its kernels by shape, and the two sync words every launch of
    the device shares (launches are stream-ordered: one stream at a time uses them)."""

    def __init__(self, device: torch.device, plan_for=plan) -> None:
        """``plan_for(hidden, inter, rows, max_shared_mem)`` picks each shape's stages (``plan``;
        a benchmark may pass its own to compare layouts)."""
        self._kernels = native.KernelCache(SOURCE, "mlp_block", device)
        self._plan_for = plan_for
        self.sync = torch.zeros(2, dtype=torch.int32, device=device)

    def _shape(self, rows: int, hidden: int, inter: int, dtype: torch.dtype, pdl: bool,
               beside: bool):  # fmt: skip
        planner = beside_plan if beside else self._plan_for
        p = planner(hidden, inter, rows, self._kernels.max_shared_mem)
        defines = {
            "DTYPE_BF16": int(dtype == torch.bfloat16), "M_ROWS": rows, "HIDDEN": hidden,
            "INTER": inter, "PAIRS": p.pairs, "DOWN_ROWS": p.down_rows, "STAGES1": p.stages1,
            "STAGES2": p.stages2, "USE_PDL": int(pdl), "EARLY": int(beside and pdl),
        }  # fmt: skip
        return defines, p

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        use_pdl: bool,
        beside: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual_out)``; ``supports`` said yes for these operands (with ``beside``).
        ``beside``: the ring in ``native.beside_share`` of an SM, and the next kernel launches
        before the wait (``EARLY`` in mlp_block.cu)."""
        rows, hidden = x.shape
        inter = w_down.shape[1]
        defines, p = self._shape(rows, hidden, inter, x.dtype, use_pdl, beside)
        kernel = self._kernels.get(defines, p.shared_mem)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        residual_out = torch.empty_like(out)
        act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        tensors = (x, residual, norm_weight, w_gate_up, w_down, out, residual_out, act, self.sync)
        args = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
        args += [ctypes.c_longlong(x.stride(0)), ctypes.c_longlong(residual.stride(0))]
        args.append(ctypes.c_float(eps))
        kernel.launch(self._kernels.num_sms, THREADS, args, use_pdl)
        return out, residual_out
