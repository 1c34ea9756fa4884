"""The gated MLP block of a decode step on the H200: the persistent launch
(``xhal/platforms/cuda/kernels/mlp_block.cu``: residual add, RMSNorm, gate_up, SiLU gate and down
in one launch, weights through TMA bulk copies, one grid barrier) against the two fused Triton
GEMVs it replaces (norm + gate_up, SiLU + down; ``fused_gemv``, the tree's decode path) and
against the read floor.

    python -m benchmarks.bench_mlp_block [--shapes llama3.2-1b llama3-8b qwen2.5-7b]
        [--rows 1 2 4] [--plans]

Peers: ``triton pair`` (the two fused GEMVs, what the tree runs for one row) and, for 2+ rows,
``tree sequence`` (CudaOps' two fused ops as the tree routes them there: its norm and activation
kernels around cuBLAS). Every variant is first checked against a float64 reference of the
unfused sequence (the residual stream, gate_up and the activation rounded to bf16 where the
unfused ops store them), then timed as one CUDA graph of LAYERS blocks chained as a model chains
them (each block's output and residual the next one's input; distinct weights per layer, more
than L2 holds), its replays issued back to back. PDL as the platform sets it for all. floor =
the weight bytes of the layers over the read-only ceiling measured in this run (the block reads
nothing else of size). ``--plans`` also times other stage layouts of the persistent launch.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import capture_graph, read_bandwidth, table, time_cuda_pipelined

SHAPES = {  # name -> (hidden, intermediate, layers in the timed chain)
    "llama3.2-1b": (2048, 8192, 8),
    "llama3-8b": (4096, 14336, 4),
    "qwen2.5-7b": (3584, 18944, 4),
}
EPS = 1e-5


def make_layers(hidden: int, inter: int, layers: int, dtype: torch.dtype) -> list[tuple]:
    """(norm weight, w_gate_up, w_down) per layer, scaled so activations stay near 1."""
    out = []
    for _ in range(layers):
        g = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
        w_gu = (torch.randn(2 * inter, hidden, device="cuda") / hidden**0.5).to(dtype)
        w_down = (torch.randn(hidden, inter, device="cuda") / inter**0.5).to(dtype)
        out.append((g, w_gu, w_down))
    return out


def reference(x, residual, g, w_gu, w_down):
    """float64 of the unfused sequence, rounded to the dtype where its ops store."""
    dtype, inter = x.dtype, w_down.shape[1]
    s = (x.double() + residual.double()).to(dtype).double()
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * g.double()
    gu = (h @ w_gu.double().T).to(dtype).double()
    gate, up = gu[:, :inter], gu[:, inter:]
    act = (gate * torch.sigmoid(gate) * up).to(dtype).double()
    return act @ w_down.double().T, s


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--plans", action="store_true", help="time other stage layouts too")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()

    from xhal.interfaces.ops import DeviceOps
    from xhal.platforms.cuda import native, pdl
    from xhal.platforms.cuda.kernels import fused_gemv, mlp_block
    from xhal.platforms.cuda.ops import CudaOps

    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    read = read_bandwidth(1 << 30)["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s; native compiler: {native.compiler()}")
    use_pdl = pdl.mode(device)
    block = mlp_block.MlpBlock(device)
    rows_out = []
    for name in args.shapes:
        hidden, inter, layers = SHAPES[name]
        weights = make_layers(hidden, inter, layers, dtype)
        layer_bytes = sum(t.numel() * t.element_size() for t in weights[0][1:])
        for rows in args.rows:
            x = torch.randn(rows, hidden, device="cuda").to(dtype)
            res = torch.randn(rows, hidden, device="cuda").to(dtype)
            g, w_gu, w_down = weights[0]
            want, want_res = reference(x, res, g, w_gu, w_down)
            variants: dict[str, object] = {}
            if mlp_block.supports(x, res, g, w_gu, w_down):
                p = mlp_block.plan(hidden, inter, rows, native.max_shared_mem(device))
                t0 = time.perf_counter()
                block(x, res, g, EPS, w_gu, w_down, bool(use_pdl))
                torch.cuda.synchronize()
                print(f"{name} rows {rows}: plan {p}, first call {time.perf_counter() - t0:.2f} s")
                variants["persistent"] = lambda a, b, g_, gu, d: block(
                    a, b, g_, EPS, gu, d, bool(use_pdl)
                )
                if args.plans:
                    for alt in alternative_plans(hidden, inter, rows, p):
                        other = mlp_block.MlpBlock(device, plan_for=lambda *_, q=alt: q)
                        label = f"persistent {alt.pairs}x{alt.down_rows}"
                        label += f" {alt.stages1}/{alt.stages2}"
                        variants[label] = lambda a, b, g_, gu, d, o=other: o(
                            a, b, g_, EPS, gu, d, bool(use_pdl)
                        )
            else:
                print(f"{name} rows {rows}: the persistent launch does not take this shape")

            def pair(a, b, g_, gu, d):
                up, summed = fused_gemv.add_rms_norm_gemv(a, b, g_, EPS, gu, use_pdl=use_pdl)
                return fused_gemv.silu_and_mul_gemv(up, d, use_pdl=use_pdl), summed

            variants["triton pair"] = pair
            if rows > 1:  # what the tree runs there: CudaOps' two fused ops route 2+ rows to
                tree = CudaOps()  # its norm / activation kernels and cuBLAS

                def tree_sequence(a, b, g_, gu, d, tree=tree):
                    return DeviceOps.add_rms_norm_gated_mlp(tree, a, b, g_, EPS, gu, d)

                variants["tree sequence"] = tree_sequence
            for label, fn in variants.items():
                out, new_res = fn(x, res, g, w_gu, w_down)
                torch.cuda.synchronize()
                err, res_ok = error(out, want), torch.equal(new_res.double(), want_res)

                last: list[torch.Tensor] = []

                def chain(fn=fn, last=last):
                    a, b = x, res
                    for g_, gu, d in weights:
                        a, b = fn(a, b, g_, gu, d)
                    last[:] = [a]  # under capture: the graph's static output

                graph = capture_graph(chain)
                static = last[0]
                graph.replay()
                torch.cuda.synchronize()
                replayed = static.clone()
                chain()
                same = bool(torch.equal(replayed, last[0]))
                ms = time_cuda_pipelined(graph.replay, steps=20, reps=7)
                us = ms * 1e3 / layers
                floor_us = layer_bytes / read * 1e6
                rows_out.append({
                    "shape": name, "rows": rows, "variant": label,
                    "us/layer": round(us, 2), "x floor": round(us / floor_us, 3),
                    "of ceiling": round(floor_us / us, 3), "max err": f"{err:.2e}",
                    "residual exact": res_ok,
                    "replay == eager": same,
                })  # fmt: skip
                del graph
    print(table(rows_out, f"MLP block per layer (floor: weight bytes at {read / 1e12:.2f} TB/s)"))


def alternative_plans(hidden: int, inter: int, rows: int, chosen) -> list:
    """A few other stage layouts that fit: shallower rings, narrower stages."""
    from xhal.platforms.cuda.kernels.mlp_block import Plan

    out = []
    layouts = ((4, 2, 2, 2), (4, 2, 3, 3), (4, 2, 4, 4), (2, 2, 3, 3), (2, 1, 4, 4))
    for pairs, down_rows, s1, s2 in layouts:
        stage1, stage2 = 2 * pairs * hidden * 2, down_rows * inter * 2
        fixed = rows * inter * 2 + 4 * (2 * 8 * 2 * pairs * rows + 8 * rows)
        used = fixed + max(s1 * stage1, s2 * stage2) + 8 * (s1 + s2)
        alt = Plan(pairs, down_rows, s1, s2, used)
        if used <= 227 * 1024 and alt != chosen:
            out.append(alt)
    return out


if __name__ == "__main__":
    main()
