"""Decode GEMV on the GPU: the Triton ``gemv`` against cuBLAS (F.linear) on Llama-3-8B's bf16
projections at M = 1, 2, 4, 8 rows (and up to 64 with ``--m``: above 16 rows gemv runs on tensor
cores): microseconds per call, weight bytes streamed per second, the fraction of the copy ceiling
measured in the same run, and the speedup over cuBLAS.

    python -m benchmarks.bench_gemv [--sweep] [--m 1 4 32 64] [--shapes o qkv]

Each path is timed as one CUDA graph of CALLS back-to-back calls (Python launch overhead
excluded, as in a served decode step) that cycle through enough copies of the weight to overflow
L2, so every call streams its weight from HBM the way successive layers do. Every shape is also
checked against an fp32 reference. ``--sweep`` times a grid of configs per (M, N, K) and prints
the best, to tune ``gemv_config``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.common import capture_graph, ceilings, table, time_cuda

SHAPES = {  # name: (N, K) of the nn.Linear weight
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SMOKE_SHAPES = {"tiny": (40, 96), "wide": (300, 64)}
CALLS = 20


def graph_us(run: Callable[[int], object], calls: int, iters: int) -> float:
    """Microseconds per call of ``run(0) .. run(calls - 1)`` captured in one CUDA graph."""
    def all_calls() -> None:
        for i in range(calls):
            run(i)

    graph = capture_graph(all_calls)
    ms = time_cuda(graph.replay, iters=iters, warmup=2)
    del graph
    return ms * 1e3 / calls


def wall_us(run: Callable[[int], object], calls: int, iters: int) -> float:
    """The interpreter smoke run's stand-in for ``graph_us``: exercises the path, measures
    nothing."""
    start = time.perf_counter()
    for i in range(calls):
        run(i)
    return (time.perf_counter() - start) * 1e6 / calls


def weight_copies(num_bytes: int, device: torch.device) -> int:
    """Enough copies that one graph's calls cycle through 4x the L2 (at least 2)."""
    if device.type != "cuda":
        return 2
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, min(CALLS, math.ceil(4 * l2 / num_bytes)))


def random_weights(n: int, k: int, device: torch.device, generator=None) -> list[torch.Tensor]:
    """``weight_copies`` bf16 ``[n, k]`` weights of random values scaled by 1 / sqrt(k)."""
    return [
        (torch.randn(n, k, device=device, generator=generator) * k**-0.5).to(torch.bfloat16)
        for _ in range(weight_copies(n * k * 2, device))
    ]


def candidates(M: int, N: int, K: int, num_sms: int) -> list[tuple[int, int, int, int, int]]:
    """The sweep grid (9-15 configs): the heuristic config at 2, 3 and 4 stages and over 8 warps,
    plus tiles of 4-32 rows holding the most and half the most weights per thread that keep the
    unreduced accumulator within 128 fp32 registers (as gemv_config's tiles do), each unsplit and
    split by ``gemv_split_k``. Every one compiles for sm_90 without register spills."""
    import triton

    from xhal.platforms.cuda.kernels.gemv import MAX_CORE_M, GemvConfig, gemv_config, gemv_split_k

    heuristic = gemv_config(M, N, K, num_sms)
    if M > MAX_CORE_M:  # tensor cores: weight tiles of 32-128 rows x 64-256, split or not
        grid = {heuristic, heuristic._replace(num_stages=3)}
        for block_n, block_k, warps in [
            (32, 128, 4),
            (64, 64, 4),
            (64, 128, 4),
            (64, 256, 4),
            (128, 128, 8),
        ]:
            block_k = min(block_k, max(16, triton.next_power_of_2(K)))
            for split_k in {1, 2, gemv_split_k(N, K, block_n, block_k, num_sms)}:
                grid.add(GemvConfig(block_n, block_k, split_k, warps, 4))
        return sorted(grid)
    grid = {heuristic._replace(num_stages=s) for s in (2, 3, 4)}
    wide = 2 * heuristic.block_n  # the same weights per thread over 8 warps
    grid.add(
        GemvConfig(
            wide, heuristic.block_k, gemv_split_k(N, K, wide, heuristic.block_k, num_sms), 8, 3
        )
    )
    most = min(64, 128 // triton.next_power_of_2(M))  # weights per thread per step, 4 warps
    for block_n in (4, 8, 16, 32):
        for per_thread in (most, most // 2):
            block_k = per_thread * 128 // block_n
            if per_thread < 8 or not 64 <= block_k <= 1024:
                continue
            block_k = min(block_k, max(16, triton.next_power_of_2(K)))
            for split_k in {1, gemv_split_k(N, K, block_n, block_k, num_sms)}:
                grid.add(GemvConfig(block_n, block_k, split_k, 4, 3))
    return sorted(grid)


def fmt_config(c: tuple[int, int, int, int, int]) -> str:
    return f"{c[0]}x{c[1]} split{c[2]} w{c[3]} st{c[4]}"


@dataclass(frozen=True)
class Setup:
    device: torch.device
    timer: Callable[[Callable[[int], object], int, int], float]
    calls: int
    iters: int
    bandwidth: float  # the copy ceiling, bytes/s
    num_sms: int


def run_case(
    setup: Setup, name: str, weights: list[torch.Tensor], M: int, sweep: bool
) -> tuple[dict, list[dict]]:
    """One (shape, M): correctness against fp32, cuBLAS and the heuristic gemv timed, and with
    ``sweep`` every candidate config timed. Returns the row and the sweep's rows, fastest first."""
    from triton.runtime.errors import OutOfResources

    from xhal.platforms.cuda.kernels.gemv import gemv, gemv_config

    N, K = weights[0].shape
    weight_bytes = weights[0].numel() * weights[0].element_size()
    x = torch.randn(M, K, dtype=weights[0].dtype, device=setup.device)
    ref = F.linear(x.float(), weights[0].float())

    def err(out):
        return (out.float() - ref).abs().max().item()

    err_cublas = err(F.linear(x, weights[0]))
    tol = max(2 * err_cublas, 2**-7 * ref.abs().max().item())  # a bf16 ulp at the largest output

    def rate(us):
        return weight_bytes / (us * 1e-6)

    config = gemv_config(M, N, K, setup.num_sms)
    err_gemv = err(gemv(x, weights[0], config=config))  # also compiles, outside any capture

    def timed(fn: Callable, config=None, iters: int = setup.iters) -> float:
        kwargs = {"config": config} if config else {}
        return setup.timer(lambda i: fn(x, weights[i % len(weights)], **kwargs), setup.calls, iters)

    us_cublas, us_gemv = timed(F.linear), timed(gemv, config)
    row = {
        "shape": name,
        "M": M,
        "N": N,
        "K": K,
        "config": fmt_config(config),
        "cublas_us": us_cublas,
        "gemv_us": us_gemv,
        "cublas_TB/s": rate(us_cublas) / 1e12,
        "gemv_TB/s": rate(us_gemv) / 1e12,
        "gemv_of_copy": rate(us_gemv) / setup.bandwidth,
        "speedup": us_cublas / us_gemv,
        "err_gemv": err_gemv,
        "err_cublas": err_cublas,
        "ok": err_gemv <= tol,
    }
    swept, skipped = [], []
    for cfg in candidates(M, N, K, setup.num_sms) if sweep else []:
        try:
            if err(gemv(x, weights[0], config=cfg)) > tol:
                skipped.append(f"{fmt_config(cfg)} (wrong)")
                continue
            us = timed(gemv, cfg, max(1, setup.iters // 3))
        except OutOfResources:  # too much shared memory for this tile and stage count
            skipped.append(f"{fmt_config(cfg)} (out of resources)")
            continue
        swept.append(
            {
                "shape": name,
                "M": M,
                "N": N,
                "K": K,
                "config": fmt_config(cfg),
                "us": us,
                "TB/s": rate(us) / 1e12,
                "of_copy": rate(us) / setup.bandwidth,
                "vs_heuristic": us_gemv / us,
                "vs_cublas": us_cublas / us,
            }
        )
    if skipped:
        print(f"{name} M={M}: skipped {', '.join(skipped)}")
    return row, sorted(swept, key=lambda r: r["us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep", action="store_true", help="also time a grid of configs per shape"
    )
    parser.add_argument(
        "--all-configs", action="store_true", help="with --sweep, print every config's time"
    )
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="rows of x")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--interpret-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (
        args.interpret_smoke
    ):  # CPU dry run of every code path, tiny shapes, under Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        setup = Setup(torch.device("cpu"), wall_us, 2, 1, 1e9, 132)
        shapes, ms_rows = SMOKE_SHAPES, [1, 3]
        print("interpreter smoke run: the timings below are meaningless")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_gemv needs a CUDA GPU (or --interpret-smoke on CPU)")
        device = torch.device("cuda", torch.cuda.current_device())
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        setup = Setup(device, graph_us, CALLS, 30, ceilings()["bandwidth"], num_sms)
        shapes, ms_rows = {name: SHAPES[name] for name in args.shapes}, args.m
    started = time.perf_counter()
    rows, best_rows, every_row, speedups = [], [], [], {}
    for name, (N, K) in shapes.items():
        copies = weight_copies(N * K * 2, setup.device)
        weights = [
            torch.randn(N, K, dtype=torch.bfloat16, device=setup.device).mul_(K**-0.5)
            for _ in range(copies)
        ]
        for M in ms_rows:
            row, swept = run_case(setup, name, weights, M, args.sweep)
            rows.append(row)
            speedups[(name, M)] = row["speedup"]
            if swept:
                best_rows.append({**swept[0], "heuristic": row["config"], "tried": len(swept)})
                every_row += swept
                speedups[(name, M)] = max(row["speedup"], swept[0]["vs_cublas"])
    print(
        table(
            rows,
            f"decode GEMV, bf16, {setup.calls} calls per CUDA graph: weight bytes / time; "
            "err = max |out - fp32 reference|",
        )
    )
    if args.all_configs and every_row:
        print(table(every_row, "sweep: every config, fastest first per (M, N, K)"))
    if best_rows:
        print(table(best_rows, "sweep: best config per (M, N, K); vs_* = its speedup"))
    summary = [
        {"shape": name, **{f"M={M}": f"{speedups[(name, M)]:.2f}x" for M in ms_rows}}
        for name in shapes
    ]
    label = "the best swept config" if args.sweep else "gemv_config"
    print(table(summary, f"speedup of gemv ({label}) over cuBLAS"))
    print(f"({time.perf_counter() - started:.0f} s after the ceilings)")


if __name__ == "__main__":
    main()
