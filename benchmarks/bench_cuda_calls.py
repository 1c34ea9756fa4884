"""Host cost of each kind of CUDA call a graph decode step can make, on this machine, entered the
ways a step is: what a step's host time is made of, and so which designs can meet a host budget.

Every row is the median of ``--iters`` single calls, each timed alone with ``perf_counter`` and
entered one of four ways: ``idle`` (right after a synchronize), ``busy`` (a 1 ms kernel queued
first, so the device is working: the served regime), ``streaming`` (a ~1 ms read of 4 GB queued
first, so the device streams HBM as a decode step does) and ``after graph`` (a 1 ms kernel, then
a 256-node graph queued: the call a step makes right after the graph launch of the step before).
``--allocations N --allocate-gb G`` first allocates G GB of device memory in N tensors, as a
model's weights and caches are, to see whether the process's allocations change a call's cost.
The calls: raw runtime calls through ``ctypes`` (no torch in between: the driver's own cost),
the torch calls the executor makes (a one-value fill, a pinned host-to-device copy, an int64 to
int32 device copy, a multi-tensor copy of device pairs), an event record, and graph launches of
1, 64 and 256 kernel nodes. "python call" is an empty function: the timer's own floor.

    python -m benchmarks.bench_cuda_calls [--iters 200] [--allocations 300 --allocate-gb 16]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import table

_SLEEP_CYCLES = 2_000_000  # about 1 ms of device time at ~2 GHz


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), or None when none is mapped."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def _graph(nodes: int, target: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph of ``nodes`` one-value kernels on ``target``, replayed once."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        target.add_(1)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(nodes):
                target.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _timed(call: Callable[[], object], before: Callable[[], object], iters: int) -> float:
    samples = []
    for _ in range(iters):
        before()
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--allocations", type=int, default=0)
    parser.add_argument("--allocate-gb", type=float, default=0.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_calls needs a CUDA device")
    device = torch.device("cuda")
    held = [  # kept alive for the whole run
        torch.empty(
            int(args.allocate_gb * 2**30 / args.allocations), dtype=torch.uint8, device=device
        )
        for _ in range(args.allocations)
    ]
    streamed = torch.ones(2**30, dtype=torch.float32, device=device)  # 4 GB
    one = torch.zeros(1, device=device)
    ids64 = torch.ones(64, dtype=torch.int64, device=device)
    ids32 = torch.zeros(64, dtype=torch.int32, device=device)
    pinned = torch.zeros(1024, dtype=torch.int32, pin_memory=True)  # 4 KB
    staged = torch.zeros(1024, dtype=torch.int32, device=device)
    pairs_dst = [torch.zeros(64, dtype=torch.int32, device=device) for _ in range(4)]
    pairs_src = [torch.ones(64, dtype=torch.int32, device=device) for _ in range(4)]
    event = torch.cuda.Event()
    graphs = {n: _graph(n, torch.zeros(1, device=device)) for n in (1, 64, 256)}
    stream = torch.cuda.current_stream().cuda_stream

    calls: dict[str, Callable[[], object]] = {"python call": lambda: None}
    rt = _cudart()
    if rt is not None:
        ptr, host = ctypes.c_void_p(staged.data_ptr()), ctypes.c_void_p(pinned.data_ptr())
        handle = ctypes.c_void_p(stream)
        calls["cudaMemsetAsync 4 B (ctypes)"] = lambda: rt.cudaMemsetAsync(ptr, 0, 4, handle)
        calls["cudaMemcpyAsync H2D 4 KB pinned (ctypes)"] = lambda: rt.cudaMemcpyAsync(
            ptr, host, 4096, 1, handle
        )
    calls |= {
        "torch fill_ (1 value)": lambda: one.fill_(1.0),
        "torch copy_ H2D 4 KB pinned": lambda: staged.copy_(pinned, non_blocking=True),
        "torch copy_ int64 -> int32 (64 values)": lambda: ids32.copy_(ids64),
        "torch _foreach_copy_ 4 device pairs": lambda: torch._foreach_copy_(
            pairs_dst, pairs_src, non_blocking=True
        ),
        "torch Event.record": lambda: event.record(),
        **{f"graph launch, {n} nodes": g.replay for n, g in graphs.items()},
    }

    def idle() -> None:
        torch.cuda.synchronize()

    def busy() -> None:
        torch.cuda.synchronize()
        torch.cuda._sleep(_SLEEP_CYCLES)

    def streaming() -> None:
        torch.cuda.synchronize()
        streamed.sum()

    def after_graph() -> None:
        busy()
        graphs[256].replay()

    entries = {"idle": idle, "busy": busy, "streaming": streaming, "after graph": after_graph}
    for name, call in calls.items():  # warm every path once
        busy()
        call()
    rows = []
    for name, call in calls.items():
        row = {"call": name}
        for entry, before in entries.items():
            row[f"{entry} us"] = round(_timed(call, before, args.iters), 2)
        rows.append(row)
    held_note = f", {len(held)} allocations held ({args.allocate_gb:g} GB)" if held else ""
    print(
        table(
            rows,
            f"host us per call, median of {args.iters}, {torch.cuda.get_device_name()}" + held_note,
        )
    )


if __name__ == "__main__":
    main()
