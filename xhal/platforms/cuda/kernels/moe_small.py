"""The routed experts for a few tokens (decode at batch 1-8): every (token, expert) pair as two
GEMVs over that expert's weights, with no sort and no padding.

At batch 1 the grouped GEMM pads each expert's one row to its 16-row tile and spends its time on
the sort and on a tile shape made for many rows; here the work is a weight stream, as in a dense
decode GEMV. Two launches:

- gate-up: one program per (pair, ``BLOCK_N`` intermediate rows) streams those gate and up rows of
  the pair's expert against the token's hidden state and stores ``silu(gate) * up`` (``act [P,
  I]``);
- down + combine: one program per (token, ``BLOCK_N`` hidden rows) loops over the token's k
  experts, accumulating each down-projection slice times ``routing weight * act`` in float32, and
  stores the token's output row in the input dtype. The combine is part of the loop: no atomics,
  no partial buffer, no reduce launch, and the same bits every run.

The pair index is the fastest grid dimension, so the programs that read the same weight rows of
an expert two tokens share run side by side (the second read tends to hit L2). Products stay
unreduced until the loop ends (one cross-lane sum per program). Grids depend only on the shapes,
so a decode graph captures the call once per bucket and replays it with any routing.

Under programmatic dependent launch (``pdl.py``) both are PDL kernels that wait at their top:
their weights depend on the routing (the router writes the ids right ahead of gate-up), so all
they gain is their launch and ramp, hidden behind the router's latency chain and gate-up's tail.
Each triggers as ``TRIGGERS`` says, after its weight stream by default: the next kernel's
programs parked through a stream cost more than the ramp they hide. Measured on the H200
(Qwen3-30B-A3B shape, batch 1, docs/h200-results.md, eleventh session): the pipelined step
2.99 ms with plain launches, 2.92-2.94 with PDL (two runs); what the down kernel might do before
its wait, two launches after the router, lost: asking L2 for its first expert's rows (29.5
against 28.3 us a layer of the router + experts chain) or all eight (36.1), and the token's
routing loaded into registers there and picked per step (2.94 -> 3.04 ms: the per-step pick
breaks the load pipeline).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xhal.platforms.cuda import pdl

# up to this many pairs (8 tokens at top-8) the pair GEMVs beat the grouped GEMM at decode;
# bench_moe's tile sweep times both paths at batches 1-16 to check the crossover
MAX_SMALL_PAIRS = 64
# under PDL the (gate-up, down) triggers (read per call, so a benchmark captures its peers with
# other values)
TRIGGERS = (pdl.LATE, pdl.LATE)


def use_small_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether ``fused_experts`` takes the pair GEMVs: shapes only, so one graph bucket always
    takes the same path. The pair GEMVs read an expert once per token that picks it, the grouped
    GEMM once per step: one token (its k experts are distinct) always; more tokens while the
    pairs are at most half the experts, where repeats are few (uniform routing: about P / 2E of
    the reads; Qwen3-MoE's 128 experts up to 8 tokens, Mixtral's 8 experts at top-2 up to 2)."""
    num_pairs = num_tokens * top_k
    return num_tokens == 1 or num_pairs <= min(MAX_SMALL_PAIRS, num_experts // 2)


class SmallMoeConfig(NamedTuple):
    """Tiles of the two launches: (rows, K step) for gate-up and for down."""

    up_block_n: int = 8
    up_block_k: int = 512
    down_block_n: int = 16
    down_block_k: int = 256
    num_warps: int = 4
    up_stages: int = 3
    # the down loop's bytes in flight are (T * H rows) x down_block_k x (stages - 1), whatever
    # the row blocks: deeper than gate-up, whose k-times-larger grid already keeps SMs full
    # (sm_90 build, batch 1: 32 KB of shared memory per program, ~56 KB in flight per SM)
    down_stages: int = 8


def small_config(num_tokens: int, hidden: int, num_sms: int = 132) -> SmallMoeConfig:
    """The down launch has one program per (token, row block): at batch 1 of hidden 2048, 16-row
    blocks give fewer programs than an H200 has SMs, so narrower blocks until every SM has one.
    The gate-up launch has k times more programs and needs no such care."""
    block_n = 16
    while block_n > 4 and num_tokens * triton.cdiv(hidden, block_n) < num_sms:
        block_n //= 2
    return SmallMoeConfig(down_block_n=block_n)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    ids_ptr,
    act_ptr,
    x_stride,
    w_stride_e,
    act_stride,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    if USE_PDL:  # the ids and x come from the router, the kernel right ahead: nothing before
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < INTER
    # w13[e]: [2I, H], gate rows first then up rows
    gate_rows = w13_ptr + expert * w_stride_e + rows.to(tl.int64)[:, None] * HIDDEN
    up_rows = gate_rows + INTER * HIDDEN
    x_row = x_ptr + token * x_stride
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        gate += tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
        up += tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
    if USE_PDL == 2:  # the weights are streamed: the down kernel's programs may take the SMs
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + pair * act_stride + rows, act.to(act_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _down_combine_kernel(
    act_ptr,
    w2_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    act_stride,
    w_stride_e,
    out_stride,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    K_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < HIDDEN
    if USE_PDL:  # every program waits (pdl.py, rule 2): act comes from gate-up, right ahead
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # one flat loop over (expert j, K step), so that the load pipeline runs across the k
    # experts instead of draining at each expert's few K steps (I = 768 is 3 steps of 256)
    for step in tl.range(0, TOP_K * K_STEPS, num_stages=NUM_STAGES):
        pair = token * TOP_K + step // K_STEPS
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(weights_ptr + pair)
        ks = (step % K_STEPS) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < INTER
        a = (
            tl.load(act_ptr + pair * act_stride + ks, mask=k_mask, other=0.0).to(tl.float32)
            * weight
        )
        # w2[e]: [H, I]; this program's BLOCK_N rows of it
        w_rows = w2_ptr + expert * w_stride_e + rows.to(tl.int64)[:, None] * INTER
        w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    if USE_PDL == 2:  # after the last weight load: the next layer's GEMV may take the SMs
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * out_stride + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def small_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: SmallMoeConfig | None = None,
    triggers: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``DeviceOps.moe_experts`` by pair GEMVs: right for any batch, but an expert that several
    tokens pick is read once per pair (the grouped GEMM reads it once per step), hence
    ``use_small_path``. ``x [T, H]`` with unit stride along H; ``w13``, ``w2`` contiguous;
    ``topk_weights`` float32 and ``topk_ids`` int32 ``[T, k]``. ``triggers`` (gate-up, down:
    ``pdl.OFF``, ``EARLY`` or ``LATE``) default to ``TRIGGERS`` where ``pdl.mode`` is on, to
    plain kernels where it is off."""
    num_tokens, top_k = topk_ids.shape
    if triggers is None:
        triggers = TRIGGERS if pdl.mode(x.device) else (pdl.OFF, pdl.OFF)
    if len(triggers) != 2 or not set(triggers) <= {pdl.OFF, pdl.EARLY, pdl.LATE}:
        raise ValueError(
            f"triggers must be two of pdl.OFF, EARLY or LATE (gate-up, down), got {triggers}"
        )
    _, two_inter, hidden = w13.shape
    config = config or small_config(num_tokens, hidden)
    inter = two_inter // 2
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    ids = ids.contiguous()
    weights = topk_weights.float().contiguous()
    out = x.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out
    act = x.new_empty(
        num_tokens * top_k, inter
    )  # [P, I], rounded to the input dtype as the grouped path does
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, config.up_block_n))](
        x,
        w13,
        ids,
        act,
        x.stride(0),
        w13.stride(0),
        act.stride(0),
        INTER=inter,
        HIDDEN=hidden,
        TOP_K=top_k,
        BLOCK_N=config.up_block_n,
        BLOCK_K=config.up_block_k,
        NUM_STAGES=config.up_stages,
        USE_PDL=triggers[0],
        num_warps=config.num_warps,
        **pdl.launch_options(triggers[0]),
    )
    _down_combine_kernel[(num_tokens, triton.cdiv(hidden, config.down_block_n))](
        act,
        w2,
        ids,
        weights,
        out,
        act.stride(0),
        w2.stride(0),
        out.stride(0),
        INTER=inter,
        HIDDEN=hidden,
        TOP_K=top_k,
        K_STEPS=triton.cdiv(inter, config.down_block_k),
        BLOCK_N=config.down_block_n,
        BLOCK_K=config.down_block_k,
        NUM_STAGES=config.down_stages,
        USE_PDL=triggers[1],
        num_warps=config.num_warps,
        **pdl.launch_options(triggers[1]),
    )
    return out
