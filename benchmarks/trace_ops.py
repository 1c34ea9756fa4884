"""Which module and op launch each CUDA kernel of a step: the step runs eagerly under
torch.profiler with every submodule of the model wrapped in a ``record_function`` named by its
path (layer indices folded into ``N``), so each kernel is attributed to the innermost module and
the outermost ``xhal::`` op (plus the aten op that launched it) around its launch. A graph replay
hides that attribution; an eager step of the same batch runs the same ops (the one exception: a
one-row linear, our GEMV only inside a graph, cuBLAS eagerly).

Used by ``bench_model --trace``."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable

import torch

from benchmarks.common import table

_MODULE = "mod:"


def _wrap_modules(model: torch.nn.Module) -> list:
    """Forward hooks that open a ``record_function`` per submodule call; returns the handles."""
    handles, stack = [], []
    for path, module in model.named_modules():
        if not path:
            continue
        name = _MODULE + re.sub(r"\.\d+(?=\.|$)", ".N", path)

        def enter(mod, args, name=name):
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            stack.append(rf)

        def leave(mod, args, out):
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    return handles


def _owner(event) -> tuple[str, str]:
    """(innermost module, outermost xhal op > launching op) of a CPU event that launched
    kernels."""
    module, op = "-", ""
    node = event
    while node is not None:
        if node.name.startswith(_MODULE) and module == "-":
            module = node.name[len(_MODULE):]
        if node.name.startswith("xhal::"):
            op = node.name
        node = node.cpu_parent
    launcher = event.name
    if not op:
        return module, launcher
    return module, op if launcher == op else f"{op} > {launcher}"


def _innermost_range(kernel, ranges) -> str:
    start, end = kernel.time_range.start, kernel.time_range.end
    around = [r for r in ranges if r.time_range.start <= start and end <= r.time_range.end]
    if not around:
        return "?"
    inner = min(around, key=lambda r: r.time_range.end - r.time_range.start)
    return inner.name[len(_MODULE):]


def kernels_by_op(model: torch.nn.Module, step: Callable[[], object], iters: int = 3):
    """Rows (module, op, kernel, launches per step, us each, us per step), the most device
    time first; a kernel no CPU op launched has op ``(no op)`` (module ``?`` outside every
    module's range)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    handles = _wrap_modules(model)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    found: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    attributed: Counter = Counter()
    for e in events:
        if e.device_type.name != "CPU" or not e.kernels:
            continue
        module, op = _owner(e)
        for k in e.kernels:
            acc = found[(module, op, k.name[:70])]
            acc[0] += 1
            acc[1] += k.duration
            attributed[k.name] += 1
    # the device timeline also holds each record_function's range (a GPU annotation, not a
    # kernel); a kernel no CPU op claimed (a Triton launch outside any op: attention) is given to
    # the innermost module range around it on the device
    on_device = [e for e in events if e.device_type.name == "CUDA"]
    ranges = [e for e in on_device if e.name.startswith(_MODULE)]
    kernels = [e for e in on_device if not e.name.startswith(_MODULE)]
    for name, count in Counter(e.name for e in kernels).items():
        missing = count - attributed[name]
        if missing <= 0:
            continue
        for e in (k for k in kernels if k.name == name):
            module = _innermost_range(e, ranges)
            acc = found[(module, "(no op)", name[:70])]
            acc[0] += missing / count  # claimed and unclaimed launches of a name look alike
            acc[1] += e.time_range.elapsed_us() * missing / count
    rows = [
        {
            "module": module,
            "op": op,
            "kernel": kernel,
            "per_step": count / iters,
            "us_each": us / count,
            "us_per_step": us / iters,
        }
        for (module, op, kernel), (count, us) in found.items()
    ]
    rows.sort(key=lambda r: r["us_per_step"], reverse=True)
    return rows


def print_kernels_by_op(model, step, title: str, num_layers: int, iters: int = 3) -> None:
    rows = kernels_by_op(model, step, iters)
    launches = sum(r["per_step"] for r in rows)
    us = sum(r["us_per_step"] for r in rows)
    print(
        table(
            rows,
            f"--- kernels by module and op, {title}: {launches:.0f} launches, {us:.0f} us per "
            f"step ({launches / num_layers:.1f}, {us / num_layers:.1f} per layer)",
        )
    )
