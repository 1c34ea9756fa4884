"""The decode batch's projections at 16 to 64 rows on the H200: the tensor-core skinny GEMM
(``xhal/platforms/cuda/kernels/skinny_mma.cu``: a cluster of CTAs splits K, TMA tiles, mma.sync,
the partials summed on chip) against cuBLAS, against the read floor.

    python -m benchmarks.bench_skinny_mma [--models 8b 1b] [--rows 16 64] [--sweep-rows 64]
        [--wgmma]

First the checks: every launch shape timed, and a few odd ones (rows that are not a multiple of
16, weights whose rows or K are not a multiple of the tile), against a float64 product; then a
chain of three PDL launches in one CUDA graph, each reading the previous output, replayed on a
new input written in place, against cuBLAS's chain. Then each projection as one CUDA graph of
20 calls cycling through enough weight copies to overflow L2, replays back to back
(``bench_stream_gemv.cycled_graph_us``); floor = the weight bytes over the read-only ceiling
measured in this run. At ``--sweep-rows`` the first six one-wave launch shapes that fill 70-100%
of the SMs (``skinny_mma.candidates``, one a block width and cluster size) are timed, and the
one ``plan`` would pick if the GPCs wasted no SM (its waves in the label), elsewhere the one
``plan`` picks; ``--wgmma`` adds the wgmma build (sm_90a) of each (its own process in
``gpu_run.sh skinny``: a fault there must not take the mma.sync figures with it).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import random_weights
from benchmarks.bench_stream_gemv import cycled_graph_us, error
from benchmarks.common import capture_graph, read_bandwidth, table

# (model, projection) -> (N, K)
PROJECTIONS = {
    ("8b", "qkv"): (6144, 4096),
    ("8b", "o"): (4096, 4096),
    ("8b", "gate_up"): (28672, 4096),
    ("8b", "down"): (4096, 14336),
    ("1b", "qkv"): (3072, 2048),
    ("1b", "o"): (2048, 2048),
    ("1b", "gate_up"): (16384, 2048),
    ("1b", "down"): (2048, 8192),
}
# (rows, N, K) checked besides the timed shapes: rows off the tile, a short last block, K off 64,
# out's rows off 8 bytes
ODD = (
    (1, 4096, 4096),
    (5, 4096, 4096),
    (17, 4096, 4096),
    (33, 4000, 4096),
    (64, 4096, 4000),
    (7, 1001, 200),
)


def waves(skinny, p, n: int) -> int:
    """How many waves the launch of ``p`` against ``n`` weight rows runs in on this device."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fit = skinny.clusters[p.ks - 1] if skinny.clusters else sms // p.ks
    return -(-p.blocks(n) // max(1, fit))


def sweep(skinny, m: int, n: int, k: int, most: int = 6) -> list:
    """The first ``most`` of ``candidates`` (one wave, ``plan``'s order) that fill 70-100% of the
    SMs, one a block width and cluster size, and the shape ``plan`` would pick on a device whose
    GPCs wasted no SM, whatever its waves here."""
    from xhal.platforms.cuda import native
    from xhal.platforms.cuda.kernels import skinny_mma

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    smem = native.max_shared_mem(torch.device("cuda"))
    found = skinny_mma.candidates(m, n, k, sms, smem, skinny.clusters)
    # one warp shape per block and cluster: a run has room for a few launches a projection
    distinct = {(p.bn, p.ks): p for p in reversed(found)}  # the first of each, in order
    filling = [p for p in distinct.values() if p.ctas(n) >= 0.7 * sms]
    filling = sorted(filling, key=found.index)[:most]
    ideal = skinny_mma.plan(m, n, k, sms, smem)
    return list(dict.fromkeys([*found[:1], *filling, *([ideal] if ideal else [])]))


def wgmma_twins(shapes: list, k: int) -> list:
    """The wgmma build of each launch shape's block and split (16 weight rows a warp)."""
    from xhal.platforms.cuda import native
    from xhal.platforms.cuda.kernels import skinny_mma

    smem = native.max_shared_mem(torch.device("cuda"))
    twins = []
    for p in shapes:
        q = skinny_mma.shape(p.mt, 16, p.bn // 16, p.ks, k, smem, wgmma=True)
        if q is not None and q not in twins:
            twins.append(q)
    return twins


def label(skinny, p, n: int) -> str:
    tag = p.label
    count = waves(skinny, p, n)
    return tag + (f" ({count} waves)" if count > 1 else "")


def check(skinny, device, use_pdl) -> list[dict]:
    rows = []
    for m, n, k in ODD:
        w = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        want = x.double() @ w.double().T
        got = skinny(x, w, use_pdl)
        base = F.linear(x, w)
        rows.append({
            "case": f"{m} rows, {n}x{k}", "plan": label(skinny, skinny.plan(m, n, k), n),
            "err": f"{error(got, want):.2e}", "cuBLAS err": f"{error(base, want):.2e}",
        })  # fmt: skip
    # a PDL chain in one graph: each launch reads the previous output
    n = k = 4096
    ws = [(torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16) for _ in range(3)]
    x = torch.randn(64, k, device=device).to(torch.bfloat16)

    def chain(f):
        y = x
        for w in ws:
            y = f(y, w)
        return y

    graph_out = {}

    def run():
        graph_out["y"] = chain(lambda a, w: skinny(a, w, use_pdl))

    graph = capture_graph(run)
    for trial in range(2):
        x.copy_(torch.randn(64, k, device=device).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want = chain(F.linear)
        rows.append({
            "case": f"PDL chain of 3, 64x4096x4096, replay {trial + 1}", "plan": "",
            "err": f"{error(graph_out['y'], want.double()):.2e}", "cuBLAS err": "(reference)",
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["8b", "1b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--sweep-rows", nargs="*", type=int, default=[64])
    parser.add_argument(
        "--wgmma", action="store_true", help="also the wgmma build of every launch shape timed"
    )
    args = parser.parse_args()

    from xhal.platforms.cuda import native, pdl
    from xhal.platforms.cuda.kernels import skinny_mma

    device = torch.device("cuda")
    read = read_bandwidth(1 << 30)["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s; native compiler: {native.compiler()}")
    use_pdl = bool(pdl.mode(device))
    skinny = skinny_mma.SkinnyMma(device)
    sizes = ", ".join(f"{size}: {fit}" for size, fit in enumerate(skinny.clusters or (), 1))
    print(f"clusters of whole-SM CTAs the device holds at once, by size: {sizes or 'unknown'}")
    if not args.wgmma:  # the wgmma run checks its builds in the table's err column
        print(
            table(check(skinny, device, use_pdl), "checks against float64 (max error / max |ref|)")
        )

    rows, best = [], []
    for (model, name), (n, k) in PROJECTIONS.items():
        if model not in args.models:
            continue
        nbytes = n * k * 2
        weights = random_weights(n, k, device)
        floor_us = nbytes / read * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            want = x.double() @ weights[0].double().T
            calls = {"cuBLAS": lambda w: F.linear(x, w)}
            shapes = sweep(skinny, m, n, k) if m in args.sweep_rows else [skinny.plan(m, n, k)]
            if args.wgmma:
                shapes += wgmma_twins(shapes, k)
            for p in shapes:
                tag = label(skinny, p, n) + (" (plan)" if p == skinny.plan(m, n, k) else "")
                calls[tag] = lambda w, p=p: skinny(x, w, use_pdl, p)
            timed = {}
            for tag, call in calls.items():
                err = error(call(weights[0]), want)
                torch.cuda.synchronize()
                us = cycled_graph_us(call, weights)
                timed[tag] = us
                rows.append({
                    "projection": f"{model} {name} {n}x{k}", "rows": m, "variant": tag,
                    "us": round(us, 2), "of read": round(floor_us / us, 3), "err": f"{err:.2e}",
                })  # fmt: skip
                print(*rows[-1].values(), sep=" | ", flush=True)  # a cut run keeps what it timed
            top = min((t for t in timed if t != "cuBLAS"), key=timed.get)
            best.append({
                "projection": f"{model} {name}", "rows": m, "cuBLAS us": round(timed["cuBLAS"], 2),
                "cuBLAS of read": round(floor_us / timed["cuBLAS"], 3), "best": top,
                "best us": round(timed[top], 2), "best of read": round(floor_us / timed[top], 3),
                "cuBLAS / best": round(timed["cuBLAS"] / timed[top], 3),
            })  # fmt: skip
    print(table(rows, f"every variant (floor: weight bytes at {read / 1e12:.2f} TB/s)"))
    print(table(best, "best launch shape against cuBLAS"))


if __name__ == "__main__":
    main()
