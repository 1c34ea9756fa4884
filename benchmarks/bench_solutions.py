"""Every implementation of every decode op side by side on the H200, for the Llama-3 8B and 3.2-1B
shapes at batch 1, 16 and 64 (context 2K): torch / cuBLAS, FlashInfer, our Triton kernels, fused
against unfused, each against its floor in the same run (bytes read / the read ceiling, or FLOPs /
the matmul ceiling, whichever is larger).

    python -m benchmarks.bench_solutions \\
        [--shapes llama3-8b llama3.2-1b] [--batches 1 16 64] [--tune] [--no-attention]

Each op is a ``Case``: its floor, a float32 reference and its implementations, each a function of
the call index ``i`` that runs on weight copy ``i``. One loop checks every implementation against
the reference (``err``, relative to the reference's largest magnitude) and times it as one CUDA
graph of ``CALLS`` back-to-back calls cycling through enough weight copies to overflow L2
(``bench_gemv.graph_us``), as successive layers of a decode step run. ``--tune`` also sweeps
launch shapes of the streaming and fused GEMVs at batch 1 and prints the best.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import graph_us
from benchmarks.bench_model import BLOCK, CTX, SHAPES, decode_metadata, head_dim
from benchmarks.common import ceilings, table, time_cuda

CALLS = 20
L2_BYTES = 200 << 20  # copies of each operand cycle past the H200's 50 MiB L2 (x4 margin)
EPS = 1e-5
Timer = Callable[[Callable[[int], object]], float]  # microseconds per call of run(i)


@dataclass
class Case:
    """One op at one batch: what it must compute and every way of computing it."""

    op: str
    m: int
    floor_us: float
    ref: torch.Tensor
    impls: dict[str, Callable[[int], torch.Tensor]] = field(default_factory=dict)


def _copies(make: Callable[[], torch.Tensor], nbytes: int) -> list[torch.Tensor]:
    return [make() for _ in range(max(1, min(CALLS, math.ceil(L2_BYTES / max(nbytes, 1)))))]


def _weights(n: int, k: int, device) -> list[torch.Tensor]:
    make = lambda: torch.randn(n, k, dtype=torch.bfloat16, device=device) * k**-0.5  # noqa: E731
    return _copies(make, n * k * 2)


def _floor_us(ceil: dict, nbytes: float, flops: float = 0.0) -> float:
    return max(nbytes / ceil["read_bandwidth"], flops / ceil["flops"]) * 1e6


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """name: (N, K) of each decoder projection's weight."""
    h, d = config["hidden_size"], head_dim(config)
    q, kv, inter = (
        config["num_attention_heads"] * d,
        config["num_key_value_heads"] * d,
        config["intermediate_size"],
    )
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def _fused_variants(pdl: bool) -> list[tuple[str, bool]]:
    return [("fused", False), ("fused_pdl", True)] if pdl else [("fused", False)]


def _gemv_for(m: int) -> Callable:
    """What CudaOps.linear runs for ``m`` rows: our GEMV for one row, cuBLAS beyond."""
    from xhal.platforms.cuda.kernels import gemv

    return gemv.gemv if m == 1 else (lambda a, w: F.linear(a, w))


def linear_case(name: str, m: int, n: int, k: int, ceil: dict, pdl: bool, device) -> Case:
    from xhal.platforms.cuda.kernels import fused_gemv, gemv

    ws, x = _weights(n, k, device), torch.randn(m, k, dtype=torch.bfloat16, device=device)
    case = Case(name, m, _floor_us(ceil, n * k * 2, 2 * m * n * k), x.float() @ ws[0].float().T)
    w = lambda i: ws[i % len(ws)]  # noqa: E731
    case.impls["cublas"] = lambda i: F.linear(x, w(i))
    if m <= gemv.MAX_M:
        case.impls["triton_gemv"] = lambda i: gemv.gemv(x, w(i))
    if m <= gemv.MAX_CORE_M:
        case.impls["triton_stream"] = lambda i: fused_gemv.stream_gemv(x, w(i))
        if pdl:
            case.impls["triton_stream_pdl"] = lambda i: fused_gemv.stream_gemv(
                x, w(i), use_pdl=True
            )
    return case


def norm_linear_case(name: str, m: int, n: int, k: int, ceil: dict, pdl: bool, device) -> Case:
    """Residual add + RMSNorm + projection: the unfused sequence (our add+norm kernel, then the
    linear CudaOps picks) against the fused kernel."""
    from xhal.platforms.cuda.kernels import fused_gemv, gemv, norm

    ws = _weights(n, k, device)
    x, res = (torch.randn(m, k, dtype=torch.bfloat16, device=device) for _ in range(2))
    g = torch.rand(k, dtype=torch.bfloat16, device=device) + 0.5
    s = (x.float() + res.float()).to(torch.bfloat16).float()
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).to(torch.bfloat16)
    case = Case(
        f"norm+{name}",
        m,
        _floor_us(ceil, n * k * 2, 2 * m * n * k),
        normed.float() @ ws[0].float().T,
    )
    w, lin = (lambda i: ws[i % len(ws)]), _gemv_for(m)
    case.impls["unfused"] = lambda i: lin(norm.fused_add_rms_norm(x, res, g, EPS)[0], w(i))
    if m <= gemv.MAX_CORE_M:
        for impl, use_pdl in _fused_variants(pdl):
            case.impls[impl] = lambda i, p=use_pdl: fused_gemv.add_rms_norm_gemv(
                x, res, g, EPS, w(i), use_pdl=p
            )[0]
    return case


def silu_down_case(m: int, n: int, k: int, ceil: dict, pdl: bool, device, fi) -> Case:
    """SiLU-and-multiply then down: FlashInfer's activation (torch without it) and the linear
    CudaOps picks, against the fused kernel."""
    from xhal.platforms.cuda.kernels import fused_gemv, gemv

    ws, x = _weights(n, k, device), torch.randn(m, 2 * k, dtype=torch.bfloat16, device=device)

    def torch_act(a: torch.Tensor) -> torch.Tensor:
        gate, up = a.float().chunk(2, -1)
        return (F.silu(gate) * up).to(a.dtype)

    act = fi.silu_and_mul if fi is not None else torch_act
    case = Case(
        "silu+down",
        m,
        _floor_us(ceil, n * k * 2, 2 * m * n * k),
        torch_act(x).float() @ ws[0].float().T,
    )
    w, lin = (lambda i: ws[i % len(ws)]), _gemv_for(m)
    case.impls["unfused"] = lambda i: lin(act(x), w(i))
    if m <= gemv.MAX_CORE_M:
        for impl, use_pdl in _fused_variants(pdl):
            case.impls[impl] = lambda i, p=use_pdl: fused_gemv.silu_and_mul_gemv(x, w(i), use_pdl=p)
    return case


def rotary_kv_case(config: dict, m: int, ceil: dict, device) -> Case:
    """Rotary then the KV write (two launches) against the fused kernel; the output compared is
    the rotated q (the fused family of the conformance suite checks the cache contents)."""
    from xhal.layers.rotary import RotaryEmbedding
    from xhal.platforms.cuda.kernels import kv_write, rotary, rotary_kv

    d, hq, hk = head_dim(config), config["num_attention_heads"], config["num_key_value_heads"]
    qkv = torch.randn(m, (hq + 2 * hk) * d, dtype=torch.bfloat16, device=device)
    q, k, v = (t.view(m, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], -1))
    pos = torch.full((m,), CTX - 1, dtype=torch.int32, device=device)
    cos_sin = RotaryEmbedding(d, d, 2 * CTX, 500000.0).cos_sin_cache.to(device)
    kc = torch.zeros(m * CTX // BLOCK + 1, BLOCK, hk, d, dtype=torch.bfloat16, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.arange(m, dtype=torch.int32, device=device) * CTX + CTX - 1

    def unfused(i: int) -> torch.Tensor:
        qr, kr = rotary.rotary_embedding(pos, q, k, cos_sin, True)
        kv_write.write_kv(kr, v, kc, vc, slots)
        return qr

    # reads q, k, v; writes the rotated q, k and the v row
    floor_us = _floor_us(ceil, m * d * 2 * 2 * (hq + 2 * hk))
    case = Case("rotary+kv_write", m, floor_us, unfused(0).float())
    case.impls["unfused"] = unfused
    case.impls["fused"] = lambda i: rotary_kv.rotary_write_kv(
        pos, q, k, v, cos_sin, True, kc, vc, slots
    )
    return case


def attention_case(config: dict, m: int, ceil: dict, platform, device) -> Case:
    """Paged decode attention at context ``CTX``: the backend of every ``paged_decode_attention``
    solution this machine can run (forced one at a time, as the conformance suite runs them),
    each planned once as a decode graph bucket is; the reference is the first (best) one's
    output."""
    from xhal.interfaces import AttentionSpec, LayerCache
    from xhal.solutions import SolutionUnavailable

    d, hq, hk = head_dim(config), config["num_attention_heads"], config["num_key_value_heads"]
    spec = AttentionSpec(
        num_heads=hq, num_kv_heads=hk, head_dim=d, dtype=torch.bfloat16, block_size=BLOCK
    )
    num_blocks = m * CTX // BLOCK + 1
    layers = max(1, min(CALLS, math.ceil(L2_BYTES / (num_blocks * BLOCK * hk * d * 4))))
    caches = [
        LayerCache(
            *(
                torch.randn(num_blocks, BLOCK, hk, d, dtype=torch.bfloat16, device=device)
                for _ in range(2)
            )
        )
        for _ in range(layers)
    ]
    _, _, meta = decode_metadata(m, CTX, device)
    q = torch.randn(m, hq, d, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(m, hk, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    kernels, impls = platform.kernels, {}
    for solution in kernels.solutions("paged_decode_attention"):
        try:
            with kernels.forcing("paged_decode_attention", solution.name):
                backend = platform.attention_backend(spec)
        except SolutionUnavailable as exc:  # a package, dtype or head dim it lacks: no row
            print(f"decode_attention {solution.name}: not run ({exc})")
            continue
        backend.bind_kv_caches(caches)
        backend.plan(meta, graph_key=("bench", m))  # a graph bucket's plan, as decode graphs run it
        impls[solution.name] = lambda i, b=backend: b.forward(i % layers, q, k, v)
    ref = next(iter(impls.values()))(0).float()
    return Case("decode_attention", m, _floor_us(ceil, m * CTX * hk * d * 2 * 2), ref, impls)


def graph_timer(run: Callable[[int], object]) -> float:
    """Microseconds per call in a CUDA graph; eagerly (and said so) for what cannot be captured."""
    return graph_us(run, CALLS, 20)


def eager_us(run: Callable[[int], object]) -> float:
    torch.cuda.synchronize()
    return time_cuda(lambda: [run(i) for i in range(CALLS)], iters=10) * 1e3 / CALLS


def measure(case: Case, timer: Timer = graph_timer) -> list[dict]:
    """Check, then time, every implementation of ``case``: one table row each."""
    rows, scale = [], float(case.ref.abs().max())
    for impl, run in case.impls.items():
        err = float((run(0).float() - case.ref).abs().max()) / scale
        try:
            us = timer(run)
        except Exception as exc:  # noqa: BLE001  an uncapturable path is a result: time it eagerly
            print(f"{case.op} {impl} in a graph: {type(exc).__name__}: {exc}; timed eagerly")
            us, impl = eager_us(run), f"{impl} (eager)"
        rows.append(
            {
                "op": case.op,
                "M": case.m,
                "impl": impl,
                "us": us,
                "floor_us": case.floor_us,
                "of_ceiling": case.floor_us / us,
                "err": err,
            }
        )
    return rows


def op_cases(
    config: dict, m: int, ceil: dict, pdl: bool, device, fi=None, platform=None
) -> Iterator[Case]:
    """Every op of one decoder layer at ``m`` rows, built one at a time (each holds its own
    weight copies); attention only with a ``platform``."""
    proj = projections(config)
    for name in proj:
        yield linear_case(name, m, *proj[name], ceil, pdl, device)
    for name in ("qkv", "gate_up"):
        yield norm_linear_case(name, m, *proj[name], ceil, pdl, device)
    yield silu_down_case(m, *proj["down"], ceil, pdl, device, fi)
    yield rotary_kv_case(config, m, ceil, device)
    if platform is not None:
        yield attention_case(config, m, ceil, platform, device)


def _sweep(op: str, floor_us: float, configs, run_with) -> list[dict]:
    """Time ``run_with(config)`` (a function of the call index) for each launch shape."""
    rows = []
    for config in configs:
        try:
            us = graph_us(run_with(config), CALLS, 10)
        except Exception as exc:  # noqa: BLE001  a shape that does not compile is a result
            print(f"tune {op} {config}: {type(exc).__name__}: {exc}")
            continue
        rows.append({"op": op, "config": config, "us": us, "of_ceiling": floor_us / us})
    return sorted(rows, key=lambda r: r["us"])


def tune_stream_gemv(name: str, n: int, k: int, ceil: dict, pdl: bool) -> list[dict]:
    """Launch shapes (block_n, block_k, split_k, warps, stages) of the streaming GEMV at batch 1,
    then PDL on the three best (each is a compile of its own)."""
    from xhal.platforms.cuda.kernels import fused_gemv

    ws, x = _weights(n, k, "cuda"), torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    floor_us = _floor_us(ceil, n * k * 2)

    def run_with(use_pdl: bool):
        return lambda cfg: (
            lambda i: fused_gemv.stream_gemv(x, ws[i % len(ws)], config=cfg, use_pdl=use_pdl)
        )

    shapes = [
        (bn, bk, sk, w, 3)
        for bn, bk in ((4, 1024), (8, 512), (16, 256))
        for sk in (1, 2)
        for w in (4, 8)
    ]
    rows = [{**r, "pdl": False} for r in _sweep(name, floor_us, shapes, run_with(False))]
    if pdl:
        best = [r["config"] for r in rows[:3]]
        rows += [{**r, "pdl": True} for r in _sweep(name, floor_us, best, run_with(True))]
    return sorted(rows, key=lambda r: r["us"])[:6]


def tune_fused(shape: str, proj: dict, ceil: dict) -> list[dict]:
    """Launch shapes of the fused GEMVs at batch 1 (no PDL), the two best of each."""
    from xhal.platforms.cuda.kernels import fused_gemv

    shapes = (
        (8, 512, 1, 4, 3),
        (16, 256, 1, 4, 3),
        (16, 512, 1, 4, 3),
        (32, 256, 1, 4, 3),
        (8, 512, 2, 4, 3),
    )
    rows = []
    for op, (n, k) in (
        ("norm+qkv", proj["qkv"]),
        ("norm+gate_up", proj["gate_up"]),
        ("silu+down", proj["down"]),
    ):
        ws = _weights(n, k, "cuda")
        x = torch.randn(1, 2 * k if op == "silu+down" else k, dtype=torch.bfloat16, device="cuda")
        res, g = torch.randn_like(x[:, :k]), torch.ones(k, dtype=torch.bfloat16, device="cuda")

        def run_with(cfg, op=op, ws=ws, x=x, res=res, g=g):
            if op == "silu+down":
                return lambda i: fused_gemv.silu_and_mul_gemv(x, ws[i % len(ws)], config=cfg)
            return lambda i: fused_gemv.add_rms_norm_gemv(
                x, res, g, EPS, ws[i % len(ws)], config=cfg
            )

        rows += [
            {"shape": shape, **r}
            for r in _sweep(op, _floor_us(ceil, n * k * 2), shapes, run_with)[:2]
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=["llama3-8b", "llama3.2-1b"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--tune", action="store_true", help="sweep the streaming and fused GEMVs' launch shapes"
    )
    parser.add_argument("--no-attention", action="store_true")
    args = parser.parse_args()
    import xhal

    platform = None if args.no_attention else xhal.platforms.get("cuda")
    ceil = ceilings()
    pdl = torch.cuda.get_device_capability()[0] >= 9
    try:
        import flashinfer as fi
    except ImportError:
        fi = None
    if args.tune:  # first: the launch shapes the TUNED tables take
        for shape in args.shapes:
            proj = projections(SHAPES[shape])
            for name in ("qkv", "o"):
                title = f"--- {shape} {name} batch 1: best launch shapes"
                print(table(tune_stream_gemv(name, *proj[name], ceil, pdl), title))
            title = f"--- {shape} fused GEMVs, batch 1: the two best launch shapes each"
            print(table(tune_fused(shape, proj, ceil), title))
    read = ceil["read_bandwidth"] / 1e12
    for shape in args.shapes:
        for m in args.batches:
            rows = []
            for case in op_cases(SHAPES[shape], m, ceil, pdl, "cuda", fi, platform):
                rows += measure(case)
            title = (
                f"--- {shape}, batch {m}: us per call in a CUDA graph; of_ceiling = floor / time "
                f"(floor: bytes / read {read:.2f} TB/s or FLOPs / matmul)"
            )
            print(table(rows, title))


if __name__ == "__main__":
    main()
