"""A mixture of experts' post-attention residual add + RMSNorm, router GEMV and top-k routing in
one launch (``DeviceOps.add_rms_norm_moe_route``) for decode batches.

Unfused, a batch-1 decode layer spends four launches here (the add+norm, the router GEMV and its
split-K reduce, the routing kernel) on 0.5 MB of router weight: each launch costs more than its
bytes. Here a grid of (token, ``BLOCK_R`` router rows) programs each recomputes the token's
add+norm from the hidden row (a few KB, from L2 after the first program), rounds the normed row
to the dtype as the unfused sequence stores it, and stores its rows' logits, rounded likewise.
Programs of the first row block also store the normed row and the new residual. The program
that finishes a token last (an acquire-release counter per token) reads the token's logits back
and routes them with the routing kernel's own code (``moe_route.softmax_top_k``), then zeroes the
counter, so the next launch, or the next replay of a captured graph, starts from zero. The
results are therefore those of the unfused sequence whatever order the programs run in.

With programmatic dependent launch (``pdl.py``) the router rows are loaded before the wait for
the kernel that produced the hidden row: the counter was last written by this kernel's previous
launch, which finished before the kernel right ahead did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda import pdl
from xhal.platforms.cuda.kernels import phase_clock
from xhal.platforms.cuda.kernels.moe_route import softmax_top_k

MAX_TOKENS = 16  # beyond, a step has the launches to spare and the router reread per token grows
MAX_HIDDEN = 8192  # a program holds the whole hidden row in registers
MAX_EXPERTS = 1024
ROW_PROGRAMS = 64  # programs per token: enough to stream the router weight, few to finish
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Benchmarks only (kernels/phase_clock.py): a program's row is token * row blocks + block;
# "routed" only the program that routed the token stamps.
CLOCK: torch.Tensor | None = None
MARKS = ("start", "waited", "normed", "logits stored", "arrived", "routed")

# one zeroed int32 counter per token slot and device; every launch leaves it zeroed again, and
# the launches of one stream (a step's layers, graph replays) run one after the other
_counters: dict[torch.device, torch.Tensor] = {}


def supports(x: torch.Tensor, residual: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Shapes the kernel takes: a decode batch of rows with unit stride, the router contiguous."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_TOKENS
        and residual.shape == x.shape
        and x.shape[1] <= MAX_HIDDEN
        and gate_weight.dim() == 2
        and gate_weight.shape[1] == x.shape[1]
        and gate_weight.shape[0] <= MAX_EXPERTS
        and x.dtype in _DTYPES
        and residual.dtype == gate_weight.dtype == x.dtype
        and x.stride(1) == 1
        and residual.stride(1) == 1
        and gate_weight.is_contiguous()
    )


@triton.jit
def _norm_route_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, logits_ptr, normed_ptr, summed_ptr, weights_ptr, ids_ptr,
    counter_ptr, x_stride, res_stride, eps,
    HIDDEN: tl.constexpr, E: tl.constexpr, K: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr, clock_ptr, CLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    program = token * NUM_BLOCKS + block
    phase_clock.start(clock_ptr, program, 5, CLOCK)
    dtype = logits_ptr.dtype.element_ty
    hs = tl.arange(0, BLOCK_H)
    hm = hs < HIDDEN
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = rows < E
    # the router rows first: the one load from memory, in flight while the hidden row (from L2)
    # is normed
    w = tl.load(
        w_ptr + rows.to(tl.int64)[:, None] * HIDDEN + hs[None, :],
        mask=rm[:, None] & hm[None, :],
        other=0.0,
    )
    if USE_PDL:  # every program waits (pdl.py): x and the residual come from the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        phase_clock.stamp(clock_ptr, program, 1, CLOCK)
    x = tl.load(x_ptr + token * x_stride + hs, mask=hm, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + token * res_stride + hs, mask=hm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + hs, mask=hm, other=0.0).to(tl.float32)
    s = (x + r).to(dtype)  # the residual stream keeps the input dtype; the norm is of it
    sf = s.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / HIDDEN + eps)
    normed = (sf * inv_rms * g).to(dtype)  # as rms_norm stores it: the router's input
    phase_clock.stamp(clock_ptr, program, 2, CLOCK)
    if block == 0:
        tl.store(summed_ptr + token * HIDDEN + hs, s, mask=hm)
        tl.store(normed_ptr + token * HIDDEN + hs, normed, mask=hm)
    logit = tl.sum(w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + token * E + rows, logit.to(dtype), mask=rm)
    phase_clock.stamp(clock_ptr, program, 3, CLOCK)
    # release: this program's logits are visible before its count; acquire: the last program
    # sees every other program's logits
    done = tl.atomic_add(counter_ptr + token, 1, sem="acq_rel", scope="gpu")
    phase_clock.stamp(clock_ptr, program, 4, CLOCK)
    if done == NUM_BLOCKS - 1:
        es = tl.arange(0, BLOCK_E)
        em = es < E
        # volatile: straight from L2, never a stale L1 line of another SM's stores
        logits = tl.load(logits_ptr + token * E + es, mask=em, other=0.0, volatile=True)
        top_w, top_i = softmax_top_k(logits.to(tl.float32), em, K, BLOCK_E, BLOCK_K, RENORMALIZE)
        slots = tl.arange(0, BLOCK_K)
        tl.store(weights_ptr + token * K + slots, top_w, mask=slots < K)
        tl.store(ids_ptr + token * K + slots, top_i, mask=slots < K)
        tl.atomic_xchg(counter_ptr + token, 0, sem="relaxed", scope="gpu")
        phase_clock.stamp(clock_ptr, program, 5, CLOCK)


def _counter(device: torch.device) -> torch.Tensor:
    counter = _counters.get(device)
    if counter is None:
        counter = _counters[device] = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device)
    return counter


def add_rms_norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_warps: int | None = None,
    row_programs: int = ROW_PROGRAMS,
    use_pdl: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DeviceOps.add_rms_norm_moe_route`` in one launch, for inputs ``supports`` accepts:
    ``(router_logits [T, E], normed [T, H], summed [T, H], weights float32 [T, k], ids int32
    [T, k])``. ``num_warps`` and ``row_programs`` (programs per token) override the launch
    shape (benchmarks/bench_moe_ops.py); ``use_pdl`` defaults to ``pdl.small_kernel(x.device)``."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..{num_experts} (the router's experts)")
    # rows per program: at least 2 unless asked for more programs than that gives (the
    # benchmark's 128-program variant of a 128-expert router)
    block_r = triton.next_power_of_2(triton.cdiv(num_experts, row_programs))
    block_r = max(block_r, 2 if row_programs == ROW_PROGRAMS else 1)
    num_blocks = triton.cdiv(num_experts, block_r)
    logits = x.new_empty(num_tokens, num_experts)
    normed, summed = x.new_empty(num_tokens, hidden), x.new_empty(num_tokens, hidden)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    block_h = triton.next_power_of_2(hidden)
    use_pdl = pdl.small_kernel(x.device) if use_pdl is None else int(bool(use_pdl))
    _norm_route_kernel[(num_tokens, num_blocks)](
        x, residual, norm_weight, gate_weight, logits, normed, summed, weights, ids,
        _counter(x.device), x.stride(0), residual.stride(0), eps,
        HIDDEN=hidden, E=num_experts, K=top_k, NUM_BLOCKS=num_blocks, BLOCK_H=block_h,
        BLOCK_R=block_r, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), RENORMALIZE=renormalize, USE_PDL=use_pdl,
        clock_ptr=CLOCK, CLOCK=CLOCK is not None,
        # one warp keeps the last program's k + 3 reductions in shuffles, as the routing kernel
        # does (bench_moe_ops, 14:40 UTC, hidden 2048, 2 rows: 6.5 us with 1 warp, 7.8 with 4)
        num_warps=num_warps or (1 if block_r * block_h <= 4096 else 4),
        **pdl.launch_options(use_pdl),
    )
    return logits, normed, summed, weights, ids
