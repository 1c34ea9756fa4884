"""A decode GEMV (optionally with the residual add + RMSNorm ahead of it) whose weights stream
through TMA bulk copies: ``gemv_stream.cu`` (what it computes and how), built by ``native.py``.

Where it goes: the one-row projections of a decode graph that are not the MLP block (qkv with
its norm, o, the LM head). Each CTA requests its first stages before waiting for the kernel
ahead, so a 2048-wide model's qkv or o slice (under 100 KB an SM) is on chip when that kernel
ends; the Triton stream GEMV holds about one tile a program in flight (``fused_gemv_config.py``).

Shapes it takes (``plan``): 1 to ``MAX_ROWS`` rows of fp16 / bf16, K a multiple of 8, no bias;
sm_90+.

``GemvStream.route`` launches the other entry, ``gemv_stream_route``: a mixture-of-experts
layer's o projection of one row with the residual add, RMSNorm, router and top-k after it
(``DeviceOps.linear_add_rms_norm_moe_route``), shapes ``supports_route`` takes.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from xhal.platforms.cuda import native

SOURCE = Path(__file__).with_name("gemv_stream.cu")
MAX_ROWS = 4
ROUTED_ROWS = 1  # the rows CudaOps sends here (the Triton GEMV's gemv_max_rows)
# a plain GEMV (no norm) comes here only from this many weight bytes. On the H200 in one run
# (benchmarks/bench_stream_gemv.py, fourteenth session) the o projections (8-34 MB) ran as fast
# or faster on the Triton stream GEMV (1B 3.67 against 4.47 us, MoE 6.16 / 6.12, 8B 10.2 /
# 10.0), which lets the next kernel launch right after its wait; the LM heads (525 MB, 1 GB) ran
# 0-4% faster here (1B 120 / 121 us, 8B 243 / 233). Every norm + qkv ran faster here.
MIN_PLAIN_BYTES = 64 << 20
THREADS = 256
_WARPS = THREADS // 32
_MAX_STAGES = 8
_RING_BYTES = 192 * 1024  # what a CTA may hold in flight: most of an SM's shared memory
MAX_ROUTE_EXPERTS = THREADS  # a thread an expert's partial logit
MAX_ROUTE_TOP_K = 32  # a lane a slot
_MAX_CTA_ROWS = 64  # a CTA's gate columns in registers: 32 a thread at most


@dataclass(frozen=True)
class Plan:
    """Weight rows per stage, stages in the ring, shared memory in all (bytes)."""

    rows: int
    stages: int
    shared_mem: int


@functools.cache
def plan(k: int, m: int, max_shared_mem: int, ring_bytes: int = _RING_BYTES,
         units: int | None = None) -> Plan | None:  # fmt: skip
    """Stages of up to 8 weight rows and 64 KB (fewer rows where three such stages would not fit
    the budget), as many as ``ring_bytes`` and ``max_shared_mem`` hold, at most 8; None where
    that is under 2 or the input rows would not fit in 64 registers a thread (``K * m <=
    16384``). Given the ``units`` of rows a CTA streams, no more stages than those. The kernel's
    layout: ring, parts, norm sums, mbarriers."""
    chunks_per_thread = -(-k // (8 * THREADS))
    if k % 8 or not 1 <= m <= MAX_ROWS or chunks_per_thread * 8 * m > 64:
        return None
    budget = min(ring_bytes, max_shared_mem)
    rows = max(1, min(8, 65536 // (k * 2), budget // (3 * k * 2)))
    stage = rows * k * 2
    fixed = 4 * (2 * _WARPS * rows * m + _WARPS * m)
    stages = min(_MAX_STAGES, min(ring_bytes, max_shared_mem - fixed - 8 * _MAX_STAGES) // stage)
    if stages < 2:
        return None
    if units is not None:  # no stage the CTA would never fill
        stages = min(stages, units)
    return Plan(rows, stages, stages * stage + fixed + 8 * stages)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None) -> bool:  # fmt: skip
    """Whether the kernel takes these operands (the caller falls back otherwise)."""
    if not native.takes_rows(x, MAX_ROWS):
        return False
    k = x.shape[1]
    rows = [x] if residual is None else [x, residual]
    tensors = [*rows, weight] + ([] if norm_weight is None else [norm_weight])
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return False
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        return False
    if residual is not None and (residual.shape != x.shape or norm_weight is None):
        return False
    if norm_weight is not None and (norm_weight.shape != (k,) or not norm_weight.is_contiguous()):
        return False
    if not native.chunk_aligned(rows, tensors):
        return False
    return plan(k, x.shape[0], native.max_shared_mem(x.device)) is not None


def beside_plan(k: int, rows: int, n: int, share: int, num_sms: int) -> Plan | None:
    """``plan`` in ``share`` bytes (half an SM's, less any fixed part beside the ring) with no
    more stages than a CTA's share of ``n`` weight rows fills: one CTA per SM over units of the
    plan's rows."""
    p = plan(k, rows, share)
    if p is None:
        return None
    units = -(-n // p.rows)
    return plan(k, rows, share, units=-(-units // min(num_sms, units)))


def route_shared_mem(experts: int, cta_rows: int) -> int:
    """The route entry's shared memory past the GEMV's (``ROUTE_FLOATS`` in the source)."""
    return 4 * (2 * cta_rows + _WARPS * experts + experts + 2 * _WARPS + 2 * MAX_ROUTE_TOP_K + 2)


def supports_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
) -> bool:
    """Whether ``gemv_stream_route`` takes these operands: one row, ``weight [N, K]`` as
    ``supports`` takes it, ``residual [1, N]``, ``norm_weight [N]`` and ``gate_weight [E, N]``
    contiguous in x's dtype with N a multiple of 8, E a multiple of 4 up to
    ``MAX_ROUTE_EXPERTS`` and ``top_k`` up to ``MAX_ROUTE_TOP_K``. What depends on the device
    (the stage width, a CTA's rows) ``route_launch`` checks."""
    if not (x.dim() == 2 and x.shape[0] == 1 and supports(x, weight)):
        return False
    n = weight.shape[0]
    experts = gate_weight.shape[0] if gate_weight.dim() == 2 else 0
    tensors = (residual, norm_weight, gate_weight)
    return (
        residual.shape == (1, n)
        and norm_weight.shape == (n,)
        and gate_weight.shape == (experts, n)
        and n % 8 == 0
        and 4 <= experts <= MAX_ROUTE_EXPERTS
        and experts % 4 == 0
        and 1 <= top_k <= min(experts, MAX_ROUTE_TOP_K)
        and all(t.is_contiguous() and t.dtype == x.dtype and t.device == x.device for t in tensors)
        and native.chunk_aligned([residual], [norm_weight, gate_weight])
    )


@dataclass(frozen=True)
class RouteLaunch:
    """A route launch's compile-time defines, shared memory (bytes) and CTAs."""

    defines: dict
    shared_mem: int
    ctas: int


def route_launch(k: int, n: int, experts: int, top_k: int, renormalize: bool, bf16: bool,
                 use_pdl: bool, beside: bool, num_sms: int,
                 max_shared_mem: int) -> RouteLaunch | None:  # fmt: skip
    """How ``gemv_stream_route`` runs o ``[n, k]`` and a router of ``experts`` on a device of
    ``num_sms`` SMs: the GEMV's plan in the shared memory the route's own part leaves (half an
    SM with ``beside``, which also lets the next kernel launch before the wait), one CTA per SM
    over units of the plan's rows. None where the plan's rows are not a multiple of 4 (the
    8-byte gate loads) or a CTA would hold more than ``_MAX_CTA_ROWS`` rows."""
    share = native.beside_share(max_shared_mem) if beside else max_shared_mem
    budget = share - route_shared_mem(experts, _MAX_CTA_ROWS)
    p = beside_plan(k, 1, n, budget, num_sms) if beside else plan(k, 1, budget)
    if p is None or p.rows % 4:
        return None
    units = -(-n // p.rows)
    ctas = min(num_sms, units)
    cta_rows = -(-units // ctas) * p.rows
    if cta_rows > _MAX_CTA_ROWS:
        return None
    defines = {
        "DTYPE_BF16": int(bf16), "M_ROWS": 1, "K": k, "R": p.rows, "STAGES": p.stages, "NORM": 0,
        "USE_PDL": int(use_pdl), "EARLY": int(beside and use_pdl), "ROUTE": 1, "N": n,
        "E": experts, "TOP_K": top_k, "RENORMALIZE": int(renormalize), "GRID": ctas,
        "CTA_ROWS": cta_rows,
    }  # fmt: skip
    return RouteLaunch(defines, p.shared_mem + route_shared_mem(experts, cta_rows), ctas)


def fits_beside(x: torch.Tensor) -> bool:
    """Whether operands ``supports`` takes also run in half an SM (``native.beside_share``;
    what fits there fits the whole SM, so nothing ``supports`` checked is asked again)."""
    share = native.beside_share(native.max_shared_mem(x.device))
    return plan(x.shape[1], x.shape[0], share) is not None


class GemvStream:
    """The launches of one device, its kernels by shape."""

    def __init__(self, device: torch.device, plan_for=plan) -> None:
        """``plan_for(k, rows, max_shared_mem)`` picks each shape's stages (``plan``; a benchmark
        may pass its own)."""
        self._kernels = native.KernelCache(SOURCE, "gemv_stream", device)
        self._route_kernels = native.KernelCache(SOURCE, "gemv_stream_route", device)
        self._plan_for = plan_for
        self._scratch: dict[int, torch.Tensor] = {}  # the route's partials by size, and counter
        self._counter = torch.zeros(1, dtype=torch.int32, device=device)

    def _grid(self, n: int, rows_per_unit: int) -> tuple[int, int]:
        """``(units, CTAs)`` of a launch over ``n`` weight rows: units of ``rows_per_unit`` rows,
        one CTA per SM at most."""
        units = -(-n // rows_per_unit)
        return units, min(self._kernels.num_sms, units)

    def _shape(self, rows: int, k: int, n: int, dtype: torch.dtype, norm: bool, pdl: bool,
               beside: bool, early: bool):  # fmt: skip
        if beside:
            share = native.beside_share(self._kernels.max_shared_mem)
            p = beside_plan(k, rows, n, share, self._kernels.num_sms)
        else:
            p = self._plan_for(k, rows, self._kernels.max_shared_mem)
        defines = {
            "DTYPE_BF16": int(dtype == torch.bfloat16), "M_ROWS": rows, "K": k, "R": p.rows,
            "STAGES": p.stages, "NORM": int(norm), "USE_PDL": int(pdl), "EARLY": int(early),
        }  # fmt: skip
        return defines, p

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        use_pdl: bool,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        beside: bool = False,
        early: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x @ weight.T, None)``, or with a residual and norm weight ``(rms_norm(x + residual)
        @ weight.T, x + residual)``; ``supports`` said yes for these operands (with ``beside``).
        ``beside``: the ring in ``native.beside_share`` of an SM; ``early``: the next kernel
        launches before the wait (``EARLY`` in gemv_stream.cu)."""
        rows, k = x.shape
        n = weight.shape[0]
        norm = residual is not None
        defines, p = self._shape(rows, k, n, x.dtype, norm, use_pdl, beside, early and use_pdl)
        kernel = self._kernels.get(defines, p.shared_mem)
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        summed = torch.empty(rows, k, dtype=x.dtype, device=x.device) if norm else None
        pointers = (x, residual, norm_weight, weight, out, summed)
        args = [ctypes.c_void_p(0 if t is None else t.data_ptr()) for t in pointers]
        args += [ctypes.c_uint(n), ctypes.c_longlong(x.stride(0))]
        args += [ctypes.c_longlong(residual.stride(0) if norm else 0), ctypes.c_float(eps)]
        kernel.launch(self._grid(n, p.rows)[1], THREADS, args, use_pdl)
        return out, summed

    def route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_weight: torch.Tensor,
        top_k: int,
        renormalize: bool,
        use_pdl: bool,
        beside: bool = False,
        timing: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...] | None:
        """``DeviceOps.linear_add_rms_norm_moe_route`` in one launch (``gemv_stream_route``):
        ``(router_logits [1, E], normed [1, N], summed [1, N], topk_weights float32 [1, k],
        topk_ids int32 [1, k])`` for operands ``supports_route`` took; None where this device's
        launch cannot take them (``route_launch``), the same answer for a shape every time.
        ``beside``: half an SM, the next kernel launched before the wait (with ``use_pdl``);
        ``timing`` (benchmarks only: int64 ``[CTAs, 8]``) builds the kernel with its phase marks
        stored there."""
        launch = route_launch(
            x.shape[1], weight.shape[0], gate_weight.shape[0], top_k, renormalize,
            x.dtype == torch.bfloat16, use_pdl, beside, self._kernels.num_sms,
            self._kernels.max_shared_mem,
        )  # fmt: skip
        if launch is None:
            return None
        kernel = self._route_kernels.get(
            {**launch.defines, "TIMING": int(timing is not None)}, launch.shared_mem
        )
        n, experts, ctas = weight.shape[0], gate_weight.shape[0], launch.ctas
        parts_size = ctas * (experts + 4)
        parts = self._scratch.get(parts_size)
        if parts is None:  # reused by every launch: each one's CTAs write before they count
            parts = self._scratch[parts_size] = torch.empty(
                parts_size, dtype=torch.float32, device=x.device
            )
        logits = x.new_empty(1, experts)
        normed, summed = x.new_empty(1, n), x.new_empty(1, n)
        weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
        pointers = (x, weight, residual, norm_weight, gate_weight, summed, normed, logits,
                    weights, ids, parts, self._counter)  # fmt: skip
        args = [ctypes.c_void_p(t.data_ptr()) for t in pointers] + [ctypes.c_float(eps)]
        if timing is not None:
            args.append(ctypes.c_void_p(timing.data_ptr()))
        kernel.launch(ctas, THREADS, args, use_pdl)
        return logits, normed, summed, weights, ids
