"""Host time of a graph decode step (device work excluded), for ``bench_model --profile``: the
whole ``execute`` call, its three parts, and the calls inside it one by one.

A step is entered four ways (``enter``): ``idle`` right after a synchronize, ``busy`` with ~20 ms
of device work queued ahead (the host never waits on the device), ``spun`` after a synchronize
and 2 ms of Python spinning (a thread that was running rather than blocked in the synchronize),
``inflight`` right after queueing the same step once (a server with async scheduling calls
``execute`` while its previous step still runs: this is the served regime).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xhal.executor import ModelExecutor

MODES = ("idle", "busy", "spun", "inflight")


def enter(mode: str, ahead: Callable[[], object] | None = None) -> None:
    """Start a timed call the way ``mode`` (one of ``MODES``) names; ``inflight`` queues
    ``ahead()`` (the step itself) after the synchronize."""
    if mode not in MODES:
        raise ValueError(f"unknown entry mode {mode!r}; one of {', '.join(MODES)}")
    torch.cuda.synchronize()
    if mode == "inflight":
        if ahead is None:
            raise ValueError("entry mode 'inflight' needs the step to queue ahead")
        ahead()
    elif mode == "busy":
        torch.cuda._sleep(40_000_000)
    elif mode == "spun":
        end = time.perf_counter() + 2e-3
        while time.perf_counter() < end:
            pass


def host_time_us(
    executor: ModelExecutor, steps: list[tuple], iters: int = 50, mode: str = "idle"
) -> float:
    """CPU time of one ``execute`` call (device work excluded), cycling over ``steps`` (ids,
    positions, metadata), entered as ``enter(mode)``."""
    samples = []
    for i in range(iters):
        ids, pos, meta = steps[i % len(steps)]
        enter(mode, lambda: executor.execute(ids, pos, meta))
        t0 = time.perf_counter()
        executor.execute(ids, pos, meta)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def profile_host(executor: ModelExecutor, ids, pos, meta, iters: int = 20) -> None:
    """Where the host time of ``execute`` goes: cProfile over ``iters`` synchronized calls."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        profiler.enable()
        executor.execute(ids, pos, meta)
        profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def host_breakdown(
    executor: ModelExecutor, ids, pos, meta, iters: int = 50, mode: str = "idle"
) -> dict[str, float]:
    """Median host microseconds of a graph decode step's parts, timed inside whole ``execute``
    calls (entered as in ``host_time_us``): staging, attention plan, graph launch, and ``rest``,
    the call less those three (its own Python: routing, bucket, capture check, replay hooks,
    the output view), so the parts of a sample add up to its whole call."""
    graphs = executor.decode_graphs
    clock = time.perf_counter
    spent = {"stage": 0.0, "plan": 0.0, "replay": 0.0}

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += clock() - t0

        return call

    # instance attributes shadow the methods for these calls only
    patched = [(graphs, "_stage", "stage"), (graphs.graphs, "replay", "replay")]
    patched += [(backend, "plan", "plan") for backend in dict.fromkeys(graphs.backends)]
    shadowed = [(owner, attr, vars(owner).get(attr)) for owner, attr, _ in patched]
    for owner, attr, name in patched:
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    samples: dict[str, list[float]] = {name: [] for name in (*spent, "rest")}
    try:
        for _ in range(iters):
            enter(mode, lambda: executor.execute(ids, pos, meta))
            for name in spent:
                spent[name] = 0.0
            t0 = clock()
            executor.execute(ids, pos, meta)
            whole = clock() - t0
            for name, dt in spent.items():
                samples[name].append(dt * 1e6)
            samples["rest"].append((whole - sum(spent.values())) * 1e6)
    finally:  # back as they were: the class's method, or an attribute the instance already had
        for owner, attr, before in shadowed:
            if before is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)
    return {f"{name}_us": sorted(v)[len(v) // 2] for name, v in samples.items()}


def _timed_calls() -> list[tuple[object, str, str]]:
    """(owner, attribute, label) of every call a graph decode step makes that may cost host time."""
    from xhal.executor.decode_graph import DecodeGraphs
    from xhal.executor.packed_inputs import PackedInputs
    from xhal.platforms.cuda.flashinfer_decode_bucket import DecodeBucket

    return [
        (torch, "_foreach_copy_", "torch._foreach_copy_"),
        (torch.Tensor, "copy_", "Tensor.copy_"),
        (torch.Tensor, "fill_", "Tensor.fill_"),
        (torch, "cumsum", "torch.cumsum"),
        (torch, "index_select", "torch.index_select"),
        (torch.cuda, "current_stream", "torch.cuda.current_stream"),
        (torch.cuda.Event, "record", "Event.record"),
        (torch.cuda.Event, "synchronize", "Event.synchronize"),
        (torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay"),
        (DecodeBucket, "plan", "FlashInfer bucket plan (numpy)"),
        (DecodeBucket, "_schedule", "FlashInfer scheduler (C++)"),
        (DecodeGraphs, "_padded_metadata", "DecodeGraphs._padded_metadata"),
        # the two staging routes: numpy into the pinned buffer, or the multi-tensor copy's lists
        (DecodeGraphs, "_stage_host", "DecodeGraphs._stage_host (numpy)"),
        (DecodeGraphs, "_stage_device", "DecodeGraphs._stage_device (lists)"),
        # begin: the wait on the host buffer's event; upload: the event record (its copy_ apart)
        (PackedInputs, "begin", "PackedInputs.begin (event wait)"),
        (PackedInputs, "upload", "PackedInputs.upload (event record)"),
    ]


@contextmanager
def timing(
    totals: dict[str, float], calls: list[tuple[object, str, str]] | None = None
) -> Iterator[None]:
    """Wrap each (owner, attribute, label) of ``calls`` (default ``_timed_calls()``) so its
    exclusive wall time (less the timed calls it makes itself) adds to ``totals[label]``, in
    seconds; the originals are back on exit."""
    originals, children = [], [0.0]  # children: time of timed calls inside the innermost open one
    for owner, name, label in calls if calls is not None else _timed_calls():
        original = getattr(owner, name)

        def timed(*args, _original=original, _label=label, **kwargs):
            children.append(0.0)
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                inner = children.pop()
                children[-1] += elapsed
                totals[_label] = totals.get(_label, 0.0) + elapsed - inner

        originals.append((owner, name, original))
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def call_breakdown(
    executor: ModelExecutor, ids, pos, meta, iters: int = 50, mode: str = "idle"
) -> list[dict]:
    """Median host microseconds per step spent in each timed call, exclusive of the timed calls it
    makes (entered as ``enter(mode)``), and the rest of ``execute`` (Python between them) as
    "other". The wrappers add about half a microsecond per call."""
    per_step: list[dict[str, float]] = []
    for _ in range(iters):
        totals: dict[str, float] = {}
        enter(mode, lambda: executor.execute(ids, pos, meta))
        with timing(totals):
            t0 = time.perf_counter()
            executor.execute(ids, pos, meta)
            totals["execute (whole call)"] = time.perf_counter() - t0
        per_step.append(totals)
    labels = sorted({k for step in per_step for k in step})
    rows = []
    for label in labels:
        values = sorted(step.get(label, 0.0) * 1e6 for step in per_step)
        rows.append({"call": label, "us_per_step": round(values[len(values) // 2], 1)})
    whole = next(r["us_per_step"] for r in rows if r["call"] == "execute (whole call)")
    inner = sum(r["us_per_step"] for r in rows if r["call"] != "execute (whole call)")
    rows.append(
        {"call": "other (Python between the calls above)", "us_per_step": round(whole - inner, 1)}
    )
    return rows


def baseline_graphs(directory: Path):
    """The ``DecodeGraphs`` class of the tree at ``directory``, as a module of its own, with that
    tree's ``staged_table.py`` (and ``packed_inputs.py`` where it has one) in place of this
    tree's while it loads: a before/after of the decode graphs in one process."""
    import sys

    executor = directory / "xhal" / "executor"
    path = executor / "decode_graph.py"
    if not path.is_file():
        raise SystemExit(f"--baseline: {path} does not exist (give the root of a checkout)")
    saved = {}
    try:
        for name in ("staged_table", "packed_inputs"):
            if (executor / f"{name}.py").is_file():
                full = f"xhal.executor.{name}"
                saved[full] = sys.modules.get(full)
                sys.modules[full] = _load(f"baseline_{name}", executor / f"{name}.py")
        return _load("baseline_decode_graph", path).DecodeGraphs
    finally:
        for full, module in saved.items():
            if module is None:
                sys.modules.pop(full, None)
            else:
                sys.modules[full] = module


def _load(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DeviceCalls(TorchDispatchMode):
    """Records the names of the tensor operations (device calls, on a GPU) dispatched while it is
    active, views left out (they queue no device work), except while ``paused``; and ``copies``,
    the tensor pairs the copy ops among them moved (a multi-tensor copy from host tensors is one
    ``cudaMemcpyAsync`` per pair on a GPU, from device tensors one kernel). A pair whose
    destination lies in one of ``host`` (host staging buffers: pinned on a GPU, plain host
    memory here) is a memcpy on the host, not a device copy, and is not counted."""

    def __init__(self, host: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.copies = 0
        self._paused = False
        self._host = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in host]

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _to_device(self, dst: torch.Tensor) -> bool:
        ptr = dst.data_ptr()
        return not any(start <= ptr < end for start, end in self._host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and not _is_view(func):
            self.ops.append(func.__name__)
            name = func.__name__.split(".")[0]
            if name in ("_foreach_copy_", "_foreach_copy"):
                self.copies += sum(map(self._to_device, args[0]))
            elif name in ("copy_", "_copy_from", "copy"):
                self.copies += self._to_device(args[0])
        return func(*args, **(kwargs or {}))


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
