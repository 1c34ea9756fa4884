"""Host cost of the device operations a graph decode step is made of, on this machine.

Each operation is timed from Python two ways: with the device idle at entry (synchronize, then
one call), and back to back while the device is kept busy by a long sleep kernel (so the host
never waits on the device: pure launch cost). A graph decode step's host time is about the sum
of its operations' costs, so this says how many operations a step can afford.

    python -m benchmarks.bench_host
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.common import table


def idle_us(op: Callable[[], object], iters: int = 200) -> float:
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        op()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[iters // 2] * 1e6


def busy_us(op: Callable[[], object], iters: int = 50) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device work queued ahead of the timed calls
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def op_costs() -> list[dict]:
    """One row per operation: its host cost with the device idle at entry and busy."""
    dev = torch.device("cuda")
    i32 = dict(dtype=torch.int32, device=dev)
    small = [torch.zeros(64, **i32) for _ in range(8)]
    pinned = torch.zeros(256, dtype=torch.int32, pin_memory=True)
    table_ = torch.zeros(64, 128, **i32)
    positions = torch.zeros(64, dtype=torch.int64, device=dev)
    out = torch.zeros(64, **i32)
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)

    one_kernel, many_kernels = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(one_kernel):
        small[0].add_(1)
    with torch.cuda.graph(many_kernels):
        for _ in range(400):
            x.mul_(1.0)
    event = torch.cuda.Event()

    ops: dict[str, Callable[[], object]] = {
        "python call (no device op)": lambda: None,
        "copy_ D2D, 64 int32": lambda: small[0].copy_(small[1], non_blocking=True),
        "_foreach_copy_ D2D, 4 tensors": lambda: torch._foreach_copy_(
            small[:4], small[4:], non_blocking=True
        ),
        "copy_ H2D pinned, 256 int32": lambda: small[2].copy_(pinned[:64], non_blocking=True),
        "index_select out=": lambda: torch.index_select(table_.view(-1), 0, positions, out=out),
        "cumsum out=": lambda: torch.cumsum(small[3], 0, dtype=torch.int32, out=small[5]),
        "fill_": lambda: small[6].fill_(1),
        "event record": lambda: event.record(),
        "graph replay, 1 kernel": one_kernel.replay,
        "graph replay, 400 kernels": many_kernels.replay,
    }
    return [
        {
            "operation": name,
            "us, device idle at entry (median)": round(idle_us(op), 1),
            "us, device busy (mean)": round(busy_us(op), 1),
        }
        for name, op in ops.items()
    ]


def main() -> None:
    print(table(op_costs(), f"--- host cost per operation on {torch.cuda.get_device_name()}"))


if __name__ == "__main__":
    main()
