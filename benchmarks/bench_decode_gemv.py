"""The batch-1 stream GEMVs of the decode steps (``fused_gemv``: norm + qkv, o, norm + gate_up,
silu + down) on the H200: each projection of the Llama-3.2-1B, Qwen3-30B-A3B (attention) and
Llama-3-8B shapes, the tree's launch shape (``fused_gemv_config.TUNED``, the peer) against
weight tiles loaded through TMA descriptors (``tma``, pipelined 2-4 stages deep) on its tiles
and a few others, every one checked against a float64 reference first. (The ninth session's
runs swept tile shapes, a whole slice loaded before the PDL wait, loads one step ahead and
persistent grids, on the kernel of commit 445524e; the tenth asked L2 for tiles ahead of their
loads; ``fused_gemv_config.py`` has the results.)

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

from benchmarks.bench_gemv import CALLS, graph_us, random_weights
from benchmarks.common import ceilings, table
from benchmarks.pdl_variants import tree_table

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
    ("8b", "norm+gate_up"): (1, 28672, 4096),
    ("8b", "silu+down"): (2, 4096, 14336),
}
HEAD_ELEMENTS = 16384  # a prefetched head of at most this many weights (64 registers a thread)


def candidates(prologue: int, N: int, K: int, num_sms: int) -> list[tuple[int, ...]]:
    """The tree's shape first (the peer: ``TUNED`` as committed, before ``BENCH_GEMV_TABLE``),
    then weight tiles through TMA descriptors (``tma``: Triton's pipeliner keeps num_stages - 1
    of them in flight in shared memory, where plain loads leave a program about one tile in
    flight), on the tree's tiles and a few others, 2-4 stages."""
    from xhal.platforms.cuda.kernels.fused_gemv_config import fused_gemv_config
    from xhal.platforms.cuda.kernels.gemv import GemvConfig

    tree = fused_gemv_config(1, N, K, num_sms, prologue, table=tree_table())
    grid = [tree]
    if K % 8 == 0:  # TMA needs 16-byte rows (bf16)
        grid += [tree._replace(num_stages=s, tma=1) for s in (3, 4)]
        for block_n, block_k, stages in ((8, 512, 4), (4, 1024, 3), (8, 1024, 3), (16, 512, 4)):
            block_k = min(block_k, triton_pow2(K))
            grid.append(GemvConfig(block_n, block_k, 1, 4, stages, 1))
    return list(dict.fromkeys(tuple(c) for c in grid))  # in order, once each


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def fmt(c: tuple[int, ...]) -> str:
    tma = " tma" if len(c) > 5 and c[5] else ""
    return f"{c[0]}x{c[1]} split{c[2]} w{c[3]} st{c[4]}{tma}"


def run_projection(
    model: str, proj: str, read_bw: float, num_sms: int, device: torch.device
) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from xhal.platforms.cuda import pdl
    from xhal.platforms.cuda.kernels import fused_gemv

    prologue, N, K = PROJECTIONS[(model, proj)]
    use_pdl = pdl.mode(device)
    g = torch.Generator(device=device).manual_seed(0)
    weights = random_weights(N, K, device, g)
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
    rows, tree_us_ = [], None
    for config in candidates(prologue, N, K, num_sms):
        try:
            err = (call(config, 0).double() - ref).abs().max().item()  # compiles, outside capture
            us = graph_us(lambda i, c=config: call(c, i), CALLS, 30)
        except OutOfResources as exc:
            print(f"{model} {proj} {fmt(config)}: out of resources ({exc})")
            continue
        tree_us_ = tree_us_ or us  # the first candidate is the tree's shape
        rows.append(
            {
                "model": model,
                "proj": proj,
                "config": fmt(config),
                "us": us,
                "of_ceiling": floor_us / us,
                "vs_tree": tree_us_ / us,
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
            "vs_tree": (tree_us_ or us) / us,
            "err": float("nan"),
            "ok": True,
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
            best.append({**win, "tree_us": ours[0]["us"], "cublas_us": cublas["us"]})
    shown = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    print(table(shown, f"every config, bf16, one row, {CALLS} calls per CUDA graph (PDL as set)"))
    if args.json:  # only what beats the tree's shape by more than the run-to-run noise
        chosen = [r for r in best if r["us"] < 0.97 * r["tree_us"]]
        with open(args.json, "w") as f:
            json.dump([[*r["_key"], *r["_config"]] for r in chosen], f)
        print(f"{args.json}: {len(chosen)} of {len(best)} projections take a new shape")
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
            "fastest correct config per projection against the tree's one and cuBLAS",
        )
    )


if __name__ == "__main__":
    main()
