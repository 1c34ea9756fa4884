"""The one-row decode projections outside the MLP block on the H200: the native stream GEMV
(``xhal/platforms/cuda/kernels/gemv_stream.cu``: weights through TMA bulk copies into a ring of
shared-memory stages, the first requested before the PDL wait; with the residual add + RMSNorm
for qkv) against the Triton stream GEMVs the tree runs there (``fused_gemv``, its TUNED launch
shapes) and cuBLAS, against the read floor.

    python -m benchmarks.bench_stream_gemv [--models 1b 8b moe] [--stages 2 4]

Each variant is checked against a float64 reference, then timed as one CUDA graph of CALLS calls
with PDL as the platform sets it (each call has a GEMV ahead of it, as in a layer's chain),
cycling through enough weight copies to overflow L2, replays issued back to back. floor = the
weight bytes over the read-only ceiling measured in this run. ``--stages`` also times rings of
that many stages (the default plan fills 192 KB).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import random_weights
from benchmarks.common import capture_graph, read_bandwidth, table, time_cuda_pipelined

CALLS = 20
EPS = 1e-5
# (model, projection) -> (norm prologue, N, K)
PROJECTIONS = {
    ("1b", "norm+qkv"): (True, 3072, 2048),
    ("1b", "o"): (False, 2048, 2048),
    ("1b", "lm_head"): (False, 128256, 2048),
    ("8b", "norm+qkv"): (True, 6144, 4096),
    ("8b", "o"): (False, 4096, 4096),
    ("8b", "lm_head"): (False, 128256, 4096),
    ("moe", "norm+qkv"): (True, 5120, 2048),
    ("moe", "o"): (False, 2048, 4096),
}


def reference(x, res, g, w, norm: bool) -> torch.Tensor:
    a = x.double()
    if norm:
        s = (a + res.double()).to(x.dtype).double()
        a = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * g.double()
    return a @ w.double().T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["1b", "8b", "moe"])
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 4])
    args = parser.parse_args()

    from xhal.platforms.cuda import native, pdl
    from xhal.platforms.cuda.kernels import fused_gemv, gemv_stream

    device = torch.device("cuda")
    read = read_bandwidth(1 << 30)["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s; native compiler: {native.compiler()}")
    use_pdl = pdl.mode(device)
    default = gemv_stream.GemvStream(device)
    rows = []
    for (model, name), (norm, n, k) in PROJECTIONS.items():
        if model not in args.models:
            continue
        nbytes = n * k * 2
        weights = random_weights(n, k, device)
        x = torch.randn(1, k, device=device).to(torch.bfloat16)
        res = torch.randn(1, k, device=device).to(torch.bfloat16)
        g = (1 + 0.1 * torch.randn(k, device=device)).to(torch.bfloat16)
        want = reference(x, res, g, weights[0], norm)
        p = gemv_stream.plan(k, 1, native.max_shared_mem(device))
        variants = {f"native {p.rows}x{p.stages}": default}
        for stages in args.stages:
            if stages != p.stages:
                alt = gemv_stream.plan(k, 1, native.max_shared_mem(device), p.rows * k * 2 * stages)
                if alt is not None:
                    variants[f"native {alt.rows}x{alt.stages}"] = gemv_stream.GemvStream(
                        device, plan_for=lambda *_, q=alt: q
                    )
        calls = {}
        for label, kernels in variants.items():
            calls[label] = lambda w, kernels=kernels: kernels(
                x, w, bool(use_pdl), res if norm else None, g if norm else None, EPS
            )[0]
        if norm:
            calls["triton (tree)"] = lambda w: fused_gemv.add_rms_norm_gemv(
                x, res, g, EPS, w, use_pdl=use_pdl
            )[0]
            calls["cuBLAS (no norm)"] = lambda w: F.linear(x, w)
        else:
            calls["triton (tree)"] = lambda w: fused_gemv.stream_gemv(x, w, use_pdl=use_pdl)
            calls["cuBLAS"] = lambda w: F.linear(x, w)
        floor_us = nbytes / read * 1e6
        for label, call in calls.items():
            out = call(weights[0])
            torch.cuda.synchronize()
            err = "-" if label.startswith("cuBLAS (no") else f"{error(out, want):.2e}"
            us = cycled_graph_us(call, weights)
            rows.append({
                "model": model, "projection": f"{name} {n}x{k}", "variant": label,
                "us": round(us, 2), "of ceiling": round(floor_us / us, 3), "max err": err,
            })  # fmt: skip
    print(table(rows, f"one-row projections (floor: weight bytes at {read / 1e12:.2f} TB/s)"))


def cycled_graph_us(call, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of ``call(w)``: CALLS calls cycling through ``weights`` captured in
    one CUDA graph, its replays issued back to back."""

    def chain() -> None:
        for i in range(CALLS):
            call(weights[i % len(weights)])

    graph = capture_graph(chain)
    us = time_cuda_pipelined(graph.replay, steps=10, reps=7) * 1e3 / CALLS
    del graph
    return us


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


if __name__ == "__main__":
    main()
