"""The batch-1 stream GEMVs of the decode steps (``fused_gemv``: norm + qkv, o, norm + gate_up,
silu + down) on the H200: each projection of the Llama-3.2-1B, Qwen3-30B-A3B (attention) and
Llama-3-8B shapes, its previous launch shape (``fused_gemv_config.PREVIOUS``, the peer) against
the prefetch, load-ahead and persistent layouts (``StreamConfig``), every one checked against a
float64 reference first; and the MoE shape's routed-expert pair GEMVs (``moe_small``), previous
layout against the default.

    python -m benchmarks.bench_decode_gemv [--models 1b moe 8b] [--json FILE]

Each config is timed as one CUDA graph of CALLS back-to-back calls with PDL as the platform
sets it (so each GEMV has a GEMV ahead of it, as in a layer's chain), cycling through enough
weight copies to overflow L2; cuBLAS (F.linear on the same weights, no fused op) is the library
peer. of_ceiling = the weight bytes at the read ceiling measured in this run / the time.
``--json`` writes the fastest config per projection, the table ``BENCH_GEMV_TABLE`` loads into
the model benchmarks' executors (``pdl_variants.py``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import CALLS, graph_us, weight_copies
from benchmarks.common import ceilings, table

# (model, projection) -> (prologue, N, K): 0 plain, 1 add + RMSNorm, 2 SiLU gate
PROJECTIONS = {
    ("1b", "norm+qkv"): (1, 3072, 2048),
    ("1b", "o"): (0, 2048, 2048),
    ("1b", "norm+gate_up"): (1, 16384, 2048),
    ("1b", "silu+down"): (2, 2048, 8192),
    ("moe", "norm+qkv"): (1, 5120, 2048),
    ("moe", "o"): (0, 2048, 4096),
    ("8b", "norm+qkv"): (1, 6144, 4096),
    ("8b", "o"): (0, 4096, 4096),
}  # (the 8B shape's gate_up and down stream at 0.90-0.92 of the ceiling already)
HEAD_ELEMENTS = 16384  # a prefetched head of at most this many weights (64 registers a thread)


def candidates(prologue: int, N: int, K: int, num_sms: int, full: bool) -> list[tuple[int, ...]]:
    """The previous shape first (the peer), it with loads one step ahead and a wider head,
    narrow row blocks without a K split, wider K steps, and persistent grids of 1x and 2x the
    SM count; ``full=False`` keeps four of them (the 8B shape's projections, already near the
    ceiling)."""
    import triton

    from xhal.platforms.cuda.kernels.fused_gemv_config import PREVIOUS, fused_gemv_config

    prev = fused_gemv_config(1, N, K, num_sms, prologue, table=PREVIOUS)
    k_split = triton.cdiv(K, prev.split_k)
    steps = triton.cdiv(k_split, prev.block_k)
    ahead = prev._replace(ahead=1)
    persistent = [
        (block_n, 512, 1, warps, 1, triton.cdiv(triton.cdiv(N, block_n), waves * num_sms), 2, 1)
        for block_n, warps, waves in ((8, 4, 2), (8, 4, 4), (16, 8, 2))
    ]
    if not full:
        grid = [prev, ahead, (4, 512, 1, 4, 1, 1, 2, 1), persistent[0]]
    else:
        grid = [prev, ahead, ahead._replace(prefetch=2), (4, 512, 1, 4, 1, 1, 2, 1)]
        grid.append((8, 1024, 1, 4, 1, 1, 1, 1))
        if 4 * K <= HEAD_ELEMENTS:
            grid.append((4, 512, 1, 4, 1, 1, triton.cdiv(K, 512), 1))
        if prev.block_n * k_split <= HEAD_ELEMENTS:
            grid.append(prev._replace(prefetch=steps))
        grid += persistent
    seen, out = set(), []
    for c in grid:
        c = tuple(c)
        if c not in seen and (len(c) < 6 or c[5] >= 1):
            seen.add(c)
            out.append(c)
    return out


def fmt(c: tuple[int, ...]) -> str:
    from xhal.platforms.cuda.kernels.fused_gemv_config import StreamConfig

    c = StreamConfig(*c)
    return (
        f"{c.block_n}x{c.block_k} split{c.split_k} w{c.num_warps} st{c.num_stages} "
        f"blocks{c.blocks} pre{c.prefetch} ahead{c.ahead}"
    )


def run_projection(
    model: str, proj: str, read_bw: float, num_sms: int, device: torch.device
) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from xhal.platforms.cuda import pdl
    from xhal.platforms.cuda.kernels import fused_gemv

    prologue, N, K = PROJECTIONS[(model, proj)]
    use_pdl = pdl.mode(device)
    g = torch.Generator(device=device).manual_seed(0)
    weights = [
        (torch.randn(N, K, device=device, generator=g) * K**-0.5).to(torch.bfloat16)
        for _ in range(weight_copies(N * K * 2, device))
    ]
    width = 2 * K if prologue == 2 else K
    x = torch.randn(1, width, device=device, generator=g).to(torch.bfloat16)
    res = torch.randn(1, K, device=device, generator=g).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(K, device=device, generator=g)).to(torch.bfloat16)
    # float64 reference of what the kernel multiplies (the residual sum rounded to bf16, the
    # silu product rounded to bf16, as the unfused ops store them)
    if prologue == 1:
        s = (x.double() + res.double()).to(torch.bfloat16).double()
        a = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.double()
    elif prologue == 2:
        gate, up = x.double()[:, :K], x.double()[:, K:]
        a = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16).double()
    else:
        a = x.double()
    ref = a @ weights[0].double().T
    tol = 2**-6 * ref.abs().max().item()  # two bf16 roundings at the largest output

    def call(config, i: int) -> torch.Tensor:
        w = weights[i % len(weights)]
        if prologue == 1:
            return fused_gemv.add_rms_norm_gemv(
                x, res, gamma, 1e-5, w, config=config, use_pdl=use_pdl
            )[0]
        if prologue == 2:
            return fused_gemv.silu_and_mul_gemv(x, w, config=config, use_pdl=use_pdl)
        return fused_gemv.stream_gemv(x, w, config=config, use_pdl=use_pdl)

    floor_us = N * K * 2 / read_bw * 1e6
    rows, prev_us = [], None
    for config in candidates(prologue, N, K, num_sms, full=model != "8b"):
        try:
            err = (call(config, 0).double() - ref).abs().max().item()  # compiles, outside capture
            us = graph_us(lambda i, c=config: call(c, i), CALLS, 30)
        except OutOfResources as exc:
            print(f"{model} {proj} {fmt(config)}: out of resources ({exc})")
            continue
        prev_us = prev_us or us  # the first candidate is the previous shape
        rows.append(
            {
                "model": model,
                "proj": proj,
                "config": fmt(config),
                "us": us,
                "of_ceiling": floor_us / us,
                "vs_previous": prev_us / us,
                "err": err,
                "ok": err <= tol,
                "_config": config,
                "_key": (prologue, N, K),
            }
        )
    xk = x[:, :K].contiguous()
    us = graph_us(lambda i: F.linear(xk, weights[i % len(weights)]), CALLS, 30)
    rows.append(  # the library peer, last
        {
            "model": model,
            "proj": proj,
            "config": "cuBLAS (GEMV only, no fused op)",
            "us": us,
            "of_ceiling": floor_us / us,
            "vs_previous": (prev_us or us) / us,
            "err": float("nan"),
            "ok": True,
        }
    )
    return rows


def run_moe_pairs(read_bw: float, device: torch.device, shape=(128, 8, 2048, 768)) -> list[dict]:
    """The routed experts of one token (Qwen3-30B-A3B: 128 experts, top-8, hidden 2048,
    intermediate 768) by the pair GEMVs, the previous layout (``moe_small.PREVIOUS``) against
    the default, each call routed to other experts (ids cycled over CALLS draws)."""
    from xhal.platforms.cuda.kernels import moe_small

    experts, top_k, hidden, inter = shape
    g = torch.Generator(device=device).manual_seed(1)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device, generator=g) * hidden**-0.5).to(
        torch.bfloat16
    )
    w2 = (torch.randn(experts, hidden, inter, device=device, generator=g) * inter**-0.5).to(
        torch.bfloat16
    )
    x = torch.randn(1, hidden, device=device, generator=g).to(torch.bfloat16)
    ids = [
        torch.randperm(experts, device=device, generator=g)[:top_k].view(1, top_k).int()
        for _ in range(CALLS)
    ]
    weights = torch.softmax(torch.randn(1, top_k, device=device, generator=g), -1)
    # float64 reference of the first routing (the activation rounded to bf16, as both paths do)
    ref = torch.zeros(1, hidden, dtype=torch.float64, device=device)
    for j, e in enumerate(ids[0][0].tolist()):
        h = x.double() @ w13[e].double().T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16)
        ref += weights[0, j].double() * (act.double() @ w2[e].double().T)
    tol = 2**-6 * ref.abs().max().item()
    nbytes = top_k * (w13[0].numel() + w2[0].numel()) * 2
    rows, prev_us = [], None
    for name, base in (("previous", moe_small.PREVIOUS), ("default", moe_small.DEFAULT)):
        config = moe_small.small_config(1, hidden)._replace(ahead=base.ahead)
        out = moe_small.small_experts(x, w13, w2, weights, ids[0], config)
        err = (out.double() - ref).abs().max().item()
        us = graph_us(
            lambda i, c=config: moe_small.small_experts(x, w13, w2, weights, ids[i], c), CALLS, 30
        )
        prev_us = prev_us or us
        rows.append(
            {
                "layout": name,
                "config": str(tuple(config)),
                "us": us,
                "of_ceiling": nbytes / read_bw * 1e6 / us,
                "vs_previous": prev_us / us,
                "err": err,
                "ok": err <= tol,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["1b", "moe", "8b"], choices=["1b", "moe", "8b"]
    )
    parser.add_argument("--json", help="write the fastest correct config per projection here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_decode_gemv needs a CUDA GPU (the kernels' CPU tests run in tests/)"
        )
    ceil = ceilings()
    device = torch.device("cuda", torch.cuda.current_device())
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    started = time.perf_counter()
    rows, best = [], []
    for model, proj in PROJECTIONS:
        if model not in args.models:
            continue
        got = run_projection(model, proj, ceil["read_bandwidth"], num_sms, device)
        rows += got
        ours = [r for r in got if "_config" in r and r["ok"]]
        cublas = got[-1]
        if len(ours) < len(got) - 1:
            print(f"{model} {proj}: {len(got) - 1 - len(ours)} configs WRONG against float64")
        if ours:
            win = min(ours, key=lambda r: r["us"])
            best.append({**win, "previous_us": ours[0]["us"], "cublas_us": cublas["us"]})
    moe_rows = run_moe_pairs(ceil["read_bandwidth"], device) if "moe" in args.models else []
    shown = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    print(table(shown, f"every config, bf16, one row, {CALLS} calls per CUDA graph (PDL as set)"))
    if args.json:  # only what beats the previous shape by more than the run-to-run noise
        chosen = [r for r in best if r["us"] < 0.97 * r["previous_us"]]
        with open(args.json, "w") as f:
            json.dump([[*r["_key"], *r["_config"]] for r in chosen], f)
        print(f"{args.json}: {len(chosen)} of {len(best)} projections take a new shape")
    if moe_rows:
        print(
            table(
                moe_rows,
                "MoE routed experts of one token (pair GEMVs: gate-up + down/combine launches), "
                "8 of 128 experts per call",
            )
        )
    print(
        f"({time.perf_counter() - started:.0f} s after the ceilings; read ceiling "
        f"{ceil['read_bandwidth'] / 1e12:.2f} TB/s)"
    )
    print(
        table(
            [
                {k: v for k, v in r.items() if not k.startswith("_") and k not in ("err", "ok")}
                for r in best
            ],
            "fastest correct config per projection against the previous one and cuBLAS",
        )
    )


if __name__ == "__main__":
    main()
