"""Which CUDA kernels a step runs and what each costs it, from CUPTI (which sees inside graph
replays): per-kernel device times, and what each kernel adds to the step's critical path where
PDL kernels overlap (``critical_path``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _profiled(fn: Callable[[], object], iters: int):
    """The profiler of ``iters`` calls of ``fn`` (run once first, outside the profile)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof


def cuda_kernel_events(fn: Callable[[], object], iters: int = 5) -> list:
    """The CUDA kernels of ``iters`` calls of ``fn`` (CUPTI sees inside graph replays), as the
    profiler's per-kernel averages (``key``, ``count``, device times summed over the calls);
    ``fn`` runs once first, outside the profile."""
    return _cuda_averages(_profiled(fn, iters))


def _cuda_averages(prof) -> list:
    return [e for e in prof.key_averages() if e.device_type.name == "CUDA"]


def critical_path(events: Sequence) -> tuple[dict[str, list[float]], float]:
    """What each kernel adds to the device's busy time, where kernels overlap (PDL launches a
    kernel before the one ahead ends, and a kernel's own time then includes its wait): in start
    order, a kernel adds the part of its span past the latest end so far. ``events`` are
    (name, start us, end us); returns ({"name after the name before it": [count, us added, us
    it overlapped the kernels ahead]}, us the device was idle between them). The added parts sum
    to the busy time, so they split a step where the kernels' own times (which overlap) cannot.
    """
    parts: dict[str, list[float]] = {}
    idle, latest, before = 0.0, None, None
    for name, start, end in sorted(events, key=lambda e: e[1]):
        # one kernel run at two places of a layer (the qkv and o GEMVs) is two rows
        part = parts.setdefault(name if before is None else f"{name} after {before}", [0, 0.0, 0.0])
        before = name[:40]
        part[0] += 1
        if latest is None or start >= latest:
            idle += 0.0 if latest is None else start - latest
            part[1] += end - start
        else:
            part[1] += max(0.0, end - latest)
            part[2] += min(end, latest) - start
        latest = end if latest is None else max(latest, end)
    return parts, idle


def _print_critical_path(prof, iters: int, num_layers: int | None) -> None:
    events = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA"
    ]
    parts, idle = critical_path(events)
    per = iters * (num_layers or 1)
    busy = sum(p[1] for p in parts.values())
    unit = "layer" if num_layers else "step"
    print(
        f"    critical path per {unit}: {busy / per:.1f} us busy, {idle / per:.1f} us idle "
        "(each kernel: launches, us it adds past the kernels ahead, us it overlaps them)"
    )
    for name, (count, added, overlap) in sorted(parts.items(), key=lambda kv: -kv[1][1])[:20]:
        print(
            f"  {count / per:6.2f} x  adds {added / per:7.2f} us  overlaps {overlap / per:7.2f} us"
            f"  {name[:120]}"
        )


def profile_kernels(
    step, title: str, iters: int = 5, num_layers: int | None = None
) -> tuple[float, float]:
    """Which kernels a step runs and their device time (CUPTI sees inside graph replays), then
    what each adds to the step's critical path (``critical_path``); returns (launches, device
    us) per step."""
    prof = _profiled(step, iters)
    events = _cuda_averages(prof)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / iters
    launches = sum(e.count for e in events) / iters
    print(f"--- kernels per step, {title}: {launches:.0f} launches, {total:.0f} us of device time")
    if (
        num_layers
    ):  # the step's launches and device time per decoder layer (LM head and embedding included)
        print(f"    per layer: {launches / num_layers:.1f} launches, {total / num_layers:.1f} us")
    for e in events[:20]:
        print(
            f"  {e.count / iters:6.0f} x {e.self_device_time_total / e.count:8.2f} us = "
            f"{e.self_device_time_total / iters:8.1f} us  {e.key[:90]}"
        )
    _print_critical_path(prof, iters, num_layers)
    return launches, total
