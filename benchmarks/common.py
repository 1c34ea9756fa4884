"""Timing helpers and the ceilings every benchmark reports against, measured in the same run."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from xhal.executor import ExecutorConfig, ModelExecutor


@contextlib.contextmanager
def environment(settings: Mapping[str, str]) -> Iterator[None]:
    """``settings`` in ``os.environ`` while the block runs, each variable as it was afterwards
    (the xhal switches a benchmark compares are read per call or per launch)."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (compiles kernels, picks cuBLAS algorithms, touches every
    operand), then captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_and_eager_executors(
    model: torch.nn.Module, platform, batches: list[int], block_size: int, ctx: int
) -> tuple[dict[bool, ModelExecutor], list]:
    """Two bf16 executors of ``model`` on one set of KV caches, keyed by ``enforce_eager``: the
    graph one with a decode bucket per batch of ``batches`` (not captured yet) and the eager one;
    caches for ``max(batches)`` sequences of ``ctx`` tokens and 64 spare blocks."""
    executors = {}
    for eager in (False, True):
        cfg = ExecutorConfig(
            dtype=torch.bfloat16,
            block_size=block_size,
            max_num_seqs=max(batches),
            max_model_len=ctx + 64,
            enforce_eager=eager,
            decode_graph_sizes=tuple(batches),
        )
        executors[eager] = ModelExecutor(model, platform, cfg)
    caches = executors[False].allocate_kv_caches(num_blocks=max(batches) * ctx // block_size + 64)
    for ex in executors.values():
        ex.bind_kv_caches(caches)
    return executors, caches


def time_graph(fn: Callable[[], object], iters: int = 50) -> float:
    """Median ms of ``fn`` captured in one CUDA graph (launch overhead removed)."""
    return time_cuda(capture_graph(fn).replay, iters=iters)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * num_bytes / (ms * 1e-3)


def matmul_flops(n: int = 8192) -> float:
    """bf16 n x n x n matmul rate in FLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_cuda(lambda: a @ b, iters=20)
    return 2 * n**3 / (ms * 1e-3)


@functools.cache
def _read_kernel():
    """A persistent Triton streaming-read kernel. Each program walks chunks ``pid, pid + grid, ...``
    of ``UNROLL * BLOCK`` float32 with no mask (the ragged tail goes to program 0 after the walk),
    issuing the chunk's ``UNROLL`` wide loads (16-byte vectors per thread) before summing any of
    them, so many bytes are in flight per SM; loads bypass L1 (``.cg``); the
    running sum is stored, so the compiler cannot drop a load. Built on first use: triton is only
    imported where it is measured. Cached: a new ``triton.jit`` function per call would be looked up
    and loaded again on every launch, host time the CUDA events count (the first version of this
    kernel "read" at 0.5-0.9 TB/s that way)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(
        x_ptr,
        out_ptr,
        num_chunks,
        n,
        BLOCK: tl.constexpr,
        UNROLL: tl.constexpr,
        TAIL_BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        grid = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(pid, num_chunks, grid):
            base = x_ptr + tl.cast(chunk, tl.int64) * (BLOCK * UNROLL)
            for u in tl.static_range(UNROLL):
                acc += tl.load(base + u * BLOCK + offs, cache_modifier=".cg")
        if pid == 0:  # the elements past the last whole chunk
            tail = tl.cast(num_chunks, tl.int64) * (BLOCK * UNROLL)
            for b in tl.static_range(TAIL_BLOCKS):
                o = tail + b * BLOCK + offs
                acc += tl.load(x_ptr + o, mask=o < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def stream_read_sum(
    x: torch.Tensor, programs: int, block: int = 4096, unroll: int = 4, num_warps: int = 8
) -> torch.Tensor:
    """Per-program partial sums of float32 ``x`` by the streaming-read kernel over ``programs``
    persistent programs; their sum is ``x.sum()`` (the benchmark does not need it, a test
    checks it)."""
    import triton

    n = x.numel()
    chunk = block * unroll
    num_chunks = n // chunk
    out = torch.empty(programs, dtype=torch.float32, device=x.device)
    tail_blocks = triton.cdiv(n - num_chunks * chunk, block)
    _read_kernel()[(programs,)](
        x,
        out,
        num_chunks,
        n,
        BLOCK=block,
        UNROLL=unroll,
        TAIL_BLOCKS=tail_blocks,
        num_warps=num_warps,
    )
    return out


# (programs per SM, BLOCK, UNROLL, warps): the read kernel's launch shapes read_bandwidth tries
READ_CONFIGS = [
    (2, 4096, 4, 8),
    (4, 4096, 4, 8),
    (4, 2048, 8, 4),
    (8, 2048, 4, 4),
    (2, 8192, 2, 8),
    (1, 8192, 4, 16),
]


# (CHUNK bytes, STAGES, CTAs per SM): the TMA bulk read kernel's shapes read_bandwidth tries
BULK_READ_CONFIGS = [(32768, 6, 1), (16384, 12, 1), (65536, 3, 1), (32768, 3, 2)]


def bulk_read_rate(x: torch.Tensor) -> float | None:
    """The best rate of ``read_bulk.cu`` (TMA bulk copies into a shared-memory ring, the way
    xhal's native kernels stream weights) over ``BULK_READ_CONFIGS`` reading ``x``, or None off
    sm_90 or without NVRTC / nvcc."""
    from pathlib import Path

    from xhal.platforms.cuda import native

    major, minor = torch.cuda.get_device_capability(x.device)
    if major < 9 or native.unavailable() is not None:
        return None
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    source, best = Path(__file__).with_name("read_bulk.cu"), 0.0
    for chunk, stages, per_sm in BULK_READ_CONFIGS:
        image = native.cubin(source, f"sm_{major}{minor}", {"CHUNK": chunk, "STAGES": stages})
        kernel = native.Kernel(image, "read_bulk", x.device, stages * (chunk + 8))
        n = x.numel() * x.element_size() // chunk
        out = torch.zeros(sms * per_sm, dtype=torch.int32, device=x.device)
        args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_uint64(n), ctypes.c_void_p(out.data_ptr())]
        ms = time_cuda(lambda k=kernel, g=sms * per_sm: k.launch(g, 32, args, False), iters=20)
        best = max(best, n * chunk / (ms * 1e-3))
    return best


def read_bandwidth(num_bytes: int = 2 << 30) -> dict[str, float]:
    """Read-only streaming rate in bytes/s (bytes read only): the ceiling of a decode step,
    which reads weights and KV and writes next to nothing. ``read`` is the best of the Triton
    streaming kernel over ``READ_CONFIGS`` (``triton_read``, when triton imports; the winning
    shape printed by ``ceilings``), the TMA bulk read kernel (``tma_read``, sm_90+ with NVRTC
    or nvcc) and a torch sum (``torch_sum_read``)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device="cuda")
    rates = {"torch_sum_read": num_bytes / (time_cuda(lambda: x.sum(), iters=20) * 1e-3)}
    bulk = bulk_read_rate(x)
    if bulk is not None:
        rates["tma_read"] = bulk
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        best = 0.0
        for per_sm, block, unroll, warps in READ_CONFIGS:
            ms = time_cuda(
                lambda p=per_sm * sms, b=block, u=unroll, w=warps: stream_read_sum(x, p, b, u, w),
                iters=20,
            )
            rate = num_bytes / (ms * 1e-3)
            if rate > best:
                best, rates["triton_read_config"] = rate, float(per_sm * 1e6 + block * 10 + unroll)
        rates["triton_read"] = best
    rates["read"] = max(v for k, v in rates.items() if k != "triton_read_config")
    return rates


def ceilings() -> dict[str, float]:
    """``bandwidth``: the read+write copy rate (the old floors' denominator, kept so figures
    stay comparable); ``read_bandwidth``: the read-only streaming rate decode floors use;
    ``flops``: the bf16 matmul rate."""
    bw, fl = copy_bandwidth(), matmul_flops()
    read = read_bandwidth()
    parts = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in read.items() if k.endswith("_read"))
    if "triton_read_config" in read:  # programs per SM, BLOCK, UNROLL of the best read kernel
        c = int(read["triton_read_config"])
        parts += f"; triton shape {c // 10**6}/SM x {c % 10**6 // 10} x {c % 10}"
    print(
        f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), read {read['read'] / 1e12:.2f} TB/s "
        f"(read only; {parts}), bf16 matmul {fl / 1e12:.0f} TFLOP/s"
    )
    return {"bandwidth": bw, "read_bandwidth": read["read"], "flops": fl}


def phase_rows(timing: torch.Tensor, marks: Sequence[str]) -> list[dict]:
    """A native kernel's phase clock as table rows: ``timing`` int64 ``[CTAs, 8]`` of
    ``%globaltimer`` (ns) per CTA at each of ``marks`` (a ``TIMING`` build), median and latest
    over the CTAs that reached the mark, in us from the earliest start."""
    t = timing.cpu().double()
    start = t[:, 0].min()
    rows = []
    for i, mark in enumerate(marks):
        col = t[:, i][t[:, i] > 0] - start
        rows.append({"mark": mark, "median us": float(col.median()) / 1e3,
                     "latest us": float(col.max()) / 1e3, "CTAs": col.numel()})  # fmt: skip
    return rows


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
