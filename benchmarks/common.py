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


def read_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Streaming-read rate in bytes/s: the best of a Triton kernel that only loads (each program
    sums its contiguous chunk into one value) and torch's sum over the same buffer. Decode reads
    weights and KV without writing much back, so this, not the copy rate, is its floor's rate."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(src, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(0, CHUNK, BLOCK):
            acc += tl.load(src + base + i + tl.arange(0, BLOCK))
        tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))

    chunk, block = 1 << 16, 4096
    words = num_bytes // 4 // chunk * chunk
    src = torch.ones(words, dtype=torch.int32, device="cuda")
    out = torch.empty(words // chunk, dtype=torch.int32, device="cuda")
    kernel_ms = time_cuda(lambda: _read[(words // chunk,)](src, out, CHUNK=chunk, BLOCK=block), iters=20)
    as_float = src.view(torch.float32)
    sum_ms = time_cuda(lambda: as_float.sum(), iters=20)
    del src, out
    return words * 4 / (min(kernel_ms, sum_ms) * 1e-3)


def matmul_flops(n: int = 8192) -> float:
    """bf16 n x n x n matmul rate in FLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_cuda(lambda: a @ b, iters=20)
    return 2 * n**3 / (ms * 1e-3)


def ceilings(read: bool = False) -> dict[str, float]:
    """Copy rate and bf16 matmul rate (plus, with ``read``, the streaming-read rate)."""
    bw, fl = copy_bandwidth(), matmul_flops()
    out = {"bandwidth": bw, "flops": fl}
    line = f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {fl / 1e12:.0f} TFLOP/s"
    if read:
        out["read_bandwidth"] = read_bandwidth()
        line += f", streaming read {out['read_bandwidth'] / 1e12:.2f} TB/s"
    print(line)
    return out


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
