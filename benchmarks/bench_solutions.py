"""Every implementation of every decode op side by side on the H200, for the Llama-3 8B and 3.2-1B
shapes at batch 1, 16 and 64 (context 2K): torch / cuBLAS, FlashInfer, our Triton kernels, fused
against unfused, each against its floor in the same run (bytes read / the read ceiling, or FLOPs /
the matmul ceiling, whichever is larger).

    python -m benchmarks.bench_solutions \\
        [--shapes llama3-8b llama3.2-1b] [--batches 1 16 64] [--tune]

Every row is timed as one CUDA graph of ``CALLS`` back-to-back calls cycling through enough
weight copies to overflow L2 (``bench_gemv.graph_us``), as successive layers of a decode step run.
Every implementation is checked against torch in float32 before it is timed (``err`` column,
relative to the output's largest magnitude). ``--tune`` also sweeps launch shapes of the streaming
GEMV for qkv and o at batch 1 (the 90%-of-read-ceiling target of issue 12) and prints the best.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import graph_us
from benchmarks.bench_model import SHAPES, head_dim
from benchmarks.common import ceilings, table, time_cuda

CALLS = 20
L2_BYTES = 200 << 20  # copies of each operand cycle past the H200's 50 MiB L2 (x4 margin)


def _copies(make: Callable[[], torch.Tensor], nbytes: int) -> list[torch.Tensor]:
    return [make() for _ in range(max(1, min(CALLS, math.ceil(L2_BYTES / max(nbytes, 1)))))]


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """name: (N, K) of each decoder projection's weight."""
    h, d = config["hidden_size"], head_dim(config)
    q, kv, inter = (
        config["num_attention_heads"] * d,
        config["num_key_value_heads"] * d,
        config["intermediate_size"],
    )
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def linear_impls(m: int, pdl_ok: bool) -> dict[str, Callable]:
    from xhal.platforms.cuda.kernels import fused_gemv, gemv

    impls: dict[str, Callable] = {"cublas": lambda x, w: F.linear(x, w)}
    if m <= gemv.MAX_M:
        impls["triton_gemv"] = lambda x, w: gemv.gemv(x, w)
    if m <= gemv.MAX_CORE_M:
        impls["triton_stream"] = lambda x, w: fused_gemv.stream_gemv(x, w)
        if pdl_ok:
            impls["triton_stream_pdl"] = lambda x, w: fused_gemv.stream_gemv(x, w, use_pdl=True)
    return impls


def bench_linear(name, m, n, k, ceil, pdl_ok) -> list[dict]:
    dtype, rows = torch.bfloat16, []
    ws = _copies(lambda: torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5, n * k * 2)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    ref = x.float() @ ws[0].float().T
    floor_us = max(n * k * 2 / ceil["read_bandwidth"], 2 * m * n * k / ceil["flops"]) * 1e6
    for impl, fn in linear_impls(m, pdl_ok).items():
        err = float((fn(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
        us = graph_us(lambda i, fn=fn: fn(x, ws[i % len(ws)]), CALLS, 20)
        rows.append(
            {
                "op": name,
                "M": m,
                "impl": impl,
                "us": us,
                "floor_us": floor_us,
                "of_ceiling": floor_us / us,
                "err": err,
            }
        )
    return rows


def bench_norm_linear(name, m, n, k, ceil, pdl_ok) -> list[dict]:
    """Residual add + RMSNorm + projection: the unfused sequence (our add+norm kernel, then cuBLAS
    or our GEMV, as CudaOps runs it) against the fused kernel."""
    from xhal.platforms.cuda.kernels import fused_gemv, gemv, norm

    dtype, rows = torch.bfloat16, []
    ws = _copies(lambda: torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5, n * k * 2)
    x, res = (
        torch.randn(m, k, dtype=dtype, device="cuda"),
        torch.randn(m, k, dtype=dtype, device="cuda"),
    )
    g = torch.rand(k, dtype=dtype, device="cuda") + 0.5
    s = (x.float() + res.float()).to(dtype).float()
    ref = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()).to(
        dtype
    ).float() @ ws[0].float().T
    floor_us = max(n * k * 2 / ceil["read_bandwidth"], 2 * m * n * k / ceil["flops"]) * 1e6
    lin = gemv.gemv if m == 1 else (lambda a, w: F.linear(a, w))  # what CudaOps.linear picks
    impls = {"unfused": lambda w: lin(norm.fused_add_rms_norm(x, res, g, 1e-5)[0], w)}
    if m <= gemv.MAX_CORE_M:
        impls["fused"] = lambda w: fused_gemv.add_rms_norm_gemv(x, res, g, 1e-5, w)[0]
        if pdl_ok:
            impls["fused_pdl"] = lambda w: fused_gemv.add_rms_norm_gemv(
                x, res, g, 1e-5, w, use_pdl=True
            )[0]
    for impl, fn in impls.items():
        err = float((fn(ws[0]).float() - ref).abs().max() / ref.abs().max())
        us = graph_us(lambda i, fn=fn: fn(ws[i % len(ws)]), CALLS, 20)
        rows.append(
            {
                "op": f"norm+{name}",
                "M": m,
                "impl": impl,
                "us": us,
                "floor_us": floor_us,
                "of_ceiling": floor_us / us,
                "err": err,
            }
        )
    return rows


def bench_silu_down(m, n, k, ceil, pdl_ok, fi) -> list[dict]:
    from xhal.platforms.cuda.kernels import fused_gemv, gemv

    dtype, rows = torch.bfloat16, []
    ws = _copies(lambda: torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5, n * k * 2)
    x = torch.randn(m, 2 * k, dtype=dtype, device="cuda")
    gate, up = x.float().chunk(2, -1)
    ref = (F.silu(gate) * up).to(dtype).float() @ ws[0].float().T
    floor_us = max(n * k * 2 / ceil["read_bandwidth"], 2 * m * n * k / ceil["flops"]) * 1e6
    act = (
        fi.silu_and_mul
        if fi is not None
        else (lambda a: (F.silu(a.float().chunk(2, -1)[0]) * a.float().chunk(2, -1)[1]).to(a.dtype))
    )
    lin = gemv.gemv if m == 1 else (lambda a, w: F.linear(a, w))  # what CudaOps.linear picks
    impls = {"unfused": lambda w: lin(act(x), w)}
    if m <= gemv.MAX_CORE_M:
        impls["fused"] = lambda w: fused_gemv.silu_and_mul_gemv(x, w)
        if pdl_ok:
            impls["fused_pdl"] = lambda w: fused_gemv.silu_and_mul_gemv(x, w, use_pdl=True)
    for impl, fn in impls.items():
        err = float((fn(ws[0]).float() - ref).abs().max() / ref.abs().max())
        us = graph_us(lambda i, fn=fn: fn(ws[i % len(ws)]), CALLS, 20)
        rows.append(
            {
                "op": "silu+down",
                "M": m,
                "impl": impl,
                "us": us,
                "floor_us": floor_us,
                "of_ceiling": floor_us / us,
                "err": err,
            }
        )
    return rows


def bench_rotary_kv(config, m, ceil) -> list[dict]:
    """Rotary then the KV write (two launches, as before) against the fused kernel."""
    from xhal.layers.rotary import RotaryEmbedding
    from xhal.platforms.cuda.kernels import kv_write, rotary, rotary_kv

    dtype, d = torch.bfloat16, head_dim(config)
    hq, hk = config["num_attention_heads"], config["num_key_value_heads"]
    qkv = torch.randn(m, (hq + 2 * hk) * d, dtype=dtype, device="cuda")
    q, k, v = (t.view(m, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], -1))
    pos = torch.full((m,), 2047, dtype=torch.int32, device="cuda")
    table_ = RotaryEmbedding(d, d, 4096, 500000.0).cos_sin_cache.cuda()
    kc = torch.zeros(m * 2048 // 16 + 1, 16, hk, d, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.arange(m, dtype=torch.int32, device="cuda") * 2048 + 2047
    bytes_ = (
        m * d * 2 * ((hq + 2 * hk) + hq + 2 * hk)
    )  # read q, k, v; write rotated q, k and v rows
    floor_us = bytes_ / ceil["read_bandwidth"] * 1e6

    def unfused():
        qr, kr = rotary.rotary_embedding(pos, q, k, table_, True)
        kv_write.write_kv(kr, v, kc, vc, slots)
        return qr

    impls = {
        "unfused": unfused,
        "fused": lambda: rotary_kv.rotary_write_kv(pos, q, k, v, table_, True, kc, vc, slots),
    }
    ref = unfused().float()
    rows = []
    for impl, fn in impls.items():
        err = float((fn().float() - ref).abs().max() / ref.abs().max())
        us = graph_us(lambda i, fn=fn: fn(), CALLS, 20)
        rows.append(
            {
                "op": "rotary+kv_write",
                "M": m,
                "impl": impl,
                "us": us,
                "floor_us": floor_us,
                "of_ceiling": floor_us / us,
                "err": err,
            }
        )
    return rows


def bench_attention(config, m, ceil, platform) -> list[dict]:
    """Paged decode attention at context 2K: FlashInfer (the default backend) and the Triton
    fallback."""
    from benchmarks.bench_model import BLOCK, CTX, decode_metadata
    from xhal.interfaces import AttentionSpec, LayerCache
    from xhal.platforms.cuda.triton_attention import TritonAttention

    d, hq, hk = head_dim(config), config["num_attention_heads"], config["num_key_value_heads"]
    spec = AttentionSpec(
        num_heads=hq, num_kv_heads=hk, head_dim=d, dtype=torch.bfloat16, block_size=BLOCK
    )
    num_blocks = m * CTX // BLOCK + 1
    layers = max(1, min(CALLS, math.ceil(L2_BYTES / (num_blocks * BLOCK * hk * d * 4))))
    caches = [
        LayerCache(
            *(
                torch.randn(num_blocks, BLOCK, hk, d, dtype=torch.bfloat16, device="cuda")
                for _ in range(2)
            )
        )
        for _ in range(layers)
    ]
    _, _, meta = decode_metadata(m, CTX, "cuda")
    q = torch.randn(m, hq, d, dtype=torch.bfloat16, device="cuda")
    k, v = (
        torch.randn(m, hk, d, dtype=torch.bfloat16, device="cuda"),
        torch.randn(m, hk, d, dtype=torch.bfloat16, device="cuda"),
    )
    floor_us = m * CTX * hk * d * 2 * 2 / ceil["read_bandwidth"] * 1e6
    rows, ref = [], None
    for impl, backend in (
        ("flashinfer", platform.attention_backend(spec)),
        ("triton", TritonAttention(spec)),
    ):
        backend.bind_kv_caches(caches)
        backend.plan(meta, graph_key=("bench", m))  # a graph bucket's plan, as decode graphs run it
        out = backend.forward(0, q, k, v).float()
        ref = out if ref is None else ref
        err = float((out - ref).abs().max() / ref.abs().max())
        try:
            us = graph_us(lambda i, b=backend: b.forward(i % layers, q, k, v), CALLS, 20)
        except Exception as exc:  # noqa: BLE001  an eager plan may not be capturable: time it eagerly instead
            print(f"{impl} attention in a graph: {type(exc).__name__}: {exc}; timed eagerly")
            torch.cuda.synchronize()
            us = (
                time_cuda(
                    lambda b=backend: [b.forward(i % layers, q, k, v) for i in range(CALLS)],
                    iters=10,
                )
                * 1e3
                / CALLS
            )
            impl += " (eager)"
        rows.append(
            {
                "op": "decode_attention",
                "M": m,
                "impl": impl,
                "us": us,
                "floor_us": floor_us,
                "of_ceiling": floor_us / us,
                "err": err,
            }
        )
    return rows


def tune_stream_gemv(name, n, k, ceil, pdl_ok) -> list[dict]:
    """Launch shapes of the streaming GEMV at batch 1: (block_n, block_k, split_k, warps,
    stages)."""
    from xhal.platforms.cuda.kernels import fused_gemv

    dtype = torch.bfloat16
    ws = _copies(lambda: torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5, n * k * 2)
    x = torch.randn(1, k, dtype=dtype, device="cuda")
    floor_us = n * k * 2 / ceil["read_bandwidth"] * 1e6
    configs = [
        (bn, bk, sk, w, 3)
        for bn, bk in ((4, 1024), (8, 512), (16, 256))
        for sk in (1, 2)
        for w in (4, 8)
    ]
    rows = []

    def timed(cfg, pdl):
        try:
            us = graph_us(
                lambda i: fused_gemv.stream_gemv(x, ws[i % len(ws)], config=cfg, use_pdl=pdl),
                CALLS,
                10,
            )
        except Exception as exc:  # noqa: BLE001  a launch shape that does not compile is a result, not a crash
            print(f"tune {name} {cfg}: {type(exc).__name__}: {exc}")
            return
        rows.append({"op": name, "config": cfg, "pdl": pdl, "us": us, "of_ceiling": floor_us / us})

    for cfg in configs:
        timed(cfg, False)
    if pdl_ok:  # PDL on the three best shapes only (each is a compile of its own)
        for cfg in [r["config"] for r in sorted(rows, key=lambda r: r["us"])[:3]]:
            timed(cfg, True)
    rows.sort(key=lambda r: r["us"])
    return rows[:6]


def tune_fused(shape: str, proj: dict, ceil) -> list[dict]:
    """Launch shapes of the fused GEMVs at batch 1 (no PDL): norm+qkv, norm+gate_up, silu+down."""
    from xhal.platforms.cuda.kernels import fused_gemv

    dtype, rows = torch.bfloat16, []
    for op, (n, k) in (
        ("norm+qkv", proj["qkv"]),
        ("norm+gate_up", proj["gate_up"]),
        ("silu+down", proj["down"]),
    ):
        ws = _copies(
            lambda n=n, k=k: torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5, n * k * 2
        )
        x = torch.randn(1, 2 * k if op == "silu+down" else k, dtype=dtype, device="cuda")
        res, g = (
            torch.randn(1, k, dtype=dtype, device="cuda"),
            torch.ones(k, dtype=dtype, device="cuda"),
        )
        floor_us = n * k * 2 / ceil["read_bandwidth"] * 1e6
        for cfg in (
            (8, 512, 1, 4, 3),
            (16, 256, 1, 4, 3),
            (16, 512, 1, 4, 3),
            (32, 256, 1, 4, 3),
            (8, 512, 2, 4, 3),
        ):
            if op == "silu+down":

                def fn(w, c=cfg, x=x):
                    return fused_gemv.silu_and_mul_gemv(x, w, config=c)
            else:

                def fn(w, c=cfg, x=x, res=res, g=g):
                    return fused_gemv.add_rms_norm_gemv(x, res, g, 1e-5, w, config=c)

            us = graph_us(lambda i, fn=fn, ws=ws: fn(ws[i % len(ws)]), CALLS, 10)
            rows.append(
                {"shape": shape, "op": op, "config": cfg, "us": us, "of_ceiling": floor_us / us}
            )
    best = {}
    for r in sorted(rows, key=lambda r: r["us"]):
        best.setdefault(r["op"], []).append(r)
    return [r for op_rows in best.values() for r in op_rows[:2]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=["llama3-8b", "llama3.2-1b"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--tune", action="store_true", help="sweep the streaming GEMV's launch shapes for qkv and o"
    )
    parser.add_argument("--no-attention", action="store_true")
    args = parser.parse_args()
    import xhal

    platform = xhal.platforms.get("cuda")
    ceil = ceilings()
    pdl_ok = torch.cuda.get_device_capability()[0] >= 9
    try:
        import flashinfer as fi
    except ImportError:
        fi = None
    if args.tune:  # first: the launch shapes CudaOps' TUNED table takes
        for shape in args.shapes:
            proj = projections(SHAPES[shape])
            for name in ("qkv", "o"):
                print(
                    table(
                        tune_stream_gemv(name, *proj[name], ceil, pdl_ok),
                        f"--- {shape} {name} batch 1: best launch shapes",
                    )
                )
            print(
                table(
                    tune_fused(shape, proj, ceil),
                    f"--- {shape} fused GEMVs, batch 1: the two best launch shapes each",
                )
            )
    for shape in args.shapes:
        config = SHAPES[shape]
        proj = projections(config)
        for m in args.batches:
            rows = []
            for name in ("qkv", "o", "gate_up", "down"):
                rows += bench_linear(name, m, *proj[name], ceil, pdl_ok)
            for name in ("qkv", "gate_up"):
                rows += bench_norm_linear(name, m, *proj[name], ceil, pdl_ok)
            rows += bench_silu_down(m, *proj["down"], ceil, pdl_ok, fi)
            rows += bench_rotary_kv(config, m, ceil)
            if not args.no_attention:
                rows += bench_attention(config, m, ceil, platform)
            print(
                table(
                    rows,
                    f"--- {shape}, batch {m}: us per call in a CUDA graph; of_ceiling = floor / "
                    f"time "
                    f"(floor: bytes / read {ceil['read_bandwidth'] / 1e12:.2f} TB/s or FLOPs / "
                    f"matmul)",
                )
            )


if __name__ == "__main__":
    main()
