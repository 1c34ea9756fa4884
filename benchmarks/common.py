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


def _read_kernel():
    """A Triton streaming-read kernel: each program sums ``ITERS`` blocks of ``BLOCK`` float32
    (cache-streaming loads) into one value, so it writes 4 bytes per ``4 * BLOCK * ITERS`` read.
    Built on first use: triton is only imported where it is measured."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def stream_read_sum(x: torch.Tensor, block: int = 2048, iters: int = 16) -> torch.Tensor:
    """Per-program partial sums of float32 ``x`` by the streaming-read kernel; their sum is
    ``x.sum()`` (the benchmark does not need it, a test checks it)."""
    import triton

    n = x.numel()
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.float32, device=x.device)
    _read_kernel()[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=8)
    return out


def read_bandwidth(num_bytes: int = 2 << 30) -> dict[str, float]:
    """Read-only streaming rate in bytes/s (bytes read only): the ceiling of a decode step,
    which reads weights and KV and writes next to nothing. ``read`` is the best of a Triton
    streaming kernel (``triton_read``, when triton imports) and a torch sum (``torch_sum_read``)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device="cuda")
    rates = {"torch_sum_read": num_bytes / (time_cuda(lambda: x.sum(), iters=20) * 1e-3)}
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        ms = time_cuda(lambda: stream_read_sum(x), iters=20)
        rates["triton_read"] = num_bytes / (ms * 1e-3)
    rates["read"] = max(rates.values())
    return rates


def ceilings() -> dict[str, float]:
    """``bandwidth``: the read+write copy rate (the old floors' denominator, kept so figures
    stay comparable); ``read_bandwidth``: the read-only streaming rate decode floors use;
    ``flops``: the bf16 matmul rate."""
    bw, fl = copy_bandwidth(), matmul_flops()
    read = read_bandwidth()
    parts = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in read.items() if k != "read")
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), read {read['read'] / 1e12:.2f} TB/s "
          f"(read only; {parts}), bf16 matmul {fl / 1e12:.0f} TFLOP/s")
    return {"bandwidth": bw, "read_bandwidth": read["read"], "flops": fl}


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
