"""Timing helpers and the ceilings every benchmark reports against, measured in the same run."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_cuda_pipelined(fn: Callable[[], object], steps: int = 20, reps: int = 5) -> float:
    """Median milliseconds per call of ``fn`` issued ``steps`` times back to back, one sync at the
    end: the host queues the next call while the device runs this one, as a server with async
    scheduling does. ``time_cuda`` instead starts each call on an idle device, so it also counts
    the host time before the first kernel."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    times.sort()
    return times[len(times) // 2]


def time_graph(fn: Callable[[], object], iters: int = 50) -> float:
    """Median ms of ``fn`` captured in one CUDA graph (launch overhead removed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, iters=iters)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=20)
    del src, dst
    return 2 * num_bytes / (ms * 1e-3)


def matmul_flops(n: int = 8192) -> float:
    """bf16 n x n x n matmul rate in FLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_cuda(lambda: a @ b, iters=20)
    return 2 * n**3 / (ms * 1e-3)


def ceilings() -> dict[str, float]:
    bw, fl = copy_bandwidth(), matmul_flops()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {fl / 1e12:.0f} TFLOP/s")
    return {"bandwidth": bw, "flops": fl}


def table(rows: list[dict], title: str) -> str:
    if not rows:
        return f"{title}: no rows"
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    lines = [title, "  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(_fmt(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
