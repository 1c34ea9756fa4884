"""The gated activation before the down projection on the real decode shapes (Llama-3 8B: gate |
up of 2 x 14336, 3.2-1B: 2 x 8192), H200: our Triton kernel (``kernels/activation.py``) against
FlashInfer's and the float32 torch sequence it replaces, each first checked against float64.

Times are per call from one CUDA graph of 20 calls over 20 different inputs (73 MB at 64 rows of
the 8B shape, past the 50 MB L2, so every call reads from HBM; in a model step the input comes
straight from the gate_up GEMM and may sit in L2). ``x_read`` is the time over (bytes read /
read ceiling of this run); the output's writes are a third of the traffic on top.

    python -m benchmarks.bench_activation [--rows 1 16 64]
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import capture_graph, read_bandwidth, table, time_cuda

WIDTHS = {"8b": 14336, "1b": 8192}
CALLS = 20


def reference(x: torch.Tensor, name: str) -> torch.Tensor:
    xd = x.double()
    d = xd.shape[-1] // 2
    gate, up = xd[..., :d], xd[..., d:]
    if name == "silu":
        act = gate / (1.0 + torch.exp(-gate))
    elif name == "none":
        act = 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0)))
    else:
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
        act = 0.5 * gate * (1.0 + torch.tanh(inner))
    return act * up


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error in units of the dtype's epsilon at the reference's largest magnitude (the
    conformance ops family's measure: 1 = one rounding)."""
    eps = torch.finfo(out.dtype).eps
    return ((out.double() - ref).abs().max() / (eps * ref.abs().max())).item()


def implementations(name: str) -> dict:
    from xhal.platforms.common.torch_ops import TorchOps  # the DeviceOps default's sequence
    from xhal.platforms.cuda.kernels import activation

    impls = {"triton": lambda x: activation.gated_activation(x, name)}
    if name == "silu":
        impls["torch"] = TorchOps.silu_and_mul
    else:
        impls["torch"] = lambda x: TorchOps.gelu_and_mul(x, name)
    try:
        import flashinfer
    except ImportError:
        return impls
    if name == "silu":
        impls["flashinfer"] = flashinfer.silu_and_mul
    elif name == "none":
        impls["flashinfer"] = flashinfer.gelu_and_mul
    return impls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    read = read_bandwidth()["read"]
    print(f"read ceiling {read / 1e12:.2f} TB/s")
    check_rows, time_rows = [], []
    g = torch.Generator(device="cuda").manual_seed(0)
    # correctness on the real shapes: every form and dtype, decode rows and a prefill chunk
    for shape_name, d in WIDTHS.items():
        for rows in (*args.rows, 4096):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = torch.randn(rows, 2 * d, device="cuda", generator=g).mul_(3).to(dtype)
                for name in ("silu", "none", "tanh"):
                    ref = reference(x, name)
                    for impl, fn in implementations(name).items():
                        if impl == "flashinfer" and dtype == torch.float32:
                            continue
                        check_rows.append(
                            {"shape": shape_name, "rows": rows, "dtype": str(dtype)[6:],
                             "act": name, "impl": impl, "ulps": ulps(fn(x), ref)}
                        )
    worst = {}
    for r in check_rows:
        key = r["impl"]
        worst[key] = max(worst.get(key, 0.0), r["ulps"])
    print(f"correctness: {len(check_rows)} cases, worst ulps per implementation: {worst}")
    bad = [r for r in check_rows if r["ulps"] > 1.0 and r["impl"] == "triton"]
    if bad:
        print(table(bad, "triton cases over one rounding"))
    # timing, bf16 (the models' dtype)
    for shape_name, d in WIDTHS.items():
        for rows in args.rows:
            xs = [
                torch.randn(rows, 2 * d, device="cuda", generator=g).to(torch.bfloat16)
                for _ in range(CALLS)
            ]
            floor_us = rows * 2 * d * 2 / read * 1e6
            row = {"shape": shape_name, "rows": rows, "read_floor_us": floor_us}
            for impl, fn in implementations("silu").items():
                graph = capture_graph(lambda fn=fn: [fn(x) for x in xs])
                us = time_cuda(graph.replay, iters=30) * 1e3 / CALLS
                row[f"{impl}_us"], row[f"{impl}_x_read"] = us, us / floor_us
            time_rows.append(row)
    print(table(time_rows, "silu_and_mul, bf16, us per call (CUDA graph of 20 calls, past L2)"))


if __name__ == "__main__":
    main()
