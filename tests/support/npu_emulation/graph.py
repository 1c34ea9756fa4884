"""Emulated NPU graphs: ``torch.npu.NPUGraph``, ``torch.npu.graph``, task groups and their update
protocols, ``ExternalEvent`` (``torch_npu/npu/graphs.py`` of the wheel).

Capture runs the work once under a ``TorchDispatchMode`` that records every op with the very
tensors it touched; replay re-runs exactly those ops on those tensors (as
``xhal/platforms/cpu_ref/graph.py``): in-place ops mutate again, out-of-place results are copied
into the captured outputs. So everything Python-side is baked at capture, and in particular FIA's
host int lists (``actual_seq_lengths*``): they are arguments of the one recorded FIA entry and
change only through

* the manual protocol (vllm-ascend's ``update_graph_params``): ``graph_task_group_begin(s)`` / FIA /
  ``h = graph_task_group_end(s)`` under capture; later ``graph_task_update_begin(update_stream,
  h)``, FIA re-issued with new arguments on ``update_stream``,
  ``graph_task_update_end(update_stream)``;
* the automatic one (``NPUGraph.update`` of ``graphs.py``): capture with
``auto_dispatch_capture=True``, then
  ``g.update(cpu_update_input=[{...}])`` before replay.

A captured ``ExternalEvent.wait`` blocks a replay until the event is recorded outside the graph:
the replay parks there and resumes when ``event.record(stream)`` runs, so "replay, then update and
record" (vllm-ascend's order) and "update, then replay" both work; ``synchronize`` raises while a
replay is parked (a device would hang).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from xhal.platforms.cpu_ref.graph import fresh_outputs

from . import runtime
from .runtime import Stream, current_stream, default_stream
from .task_update import validate

# ops that read tensor values on the host or size outputs by them: illegal under capture
_HOST_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::item",
    "aten::equal",
    "aten::is_nonzero",
}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}

# filled by fia.py: ops that auto_dispatch_capture wraps in a task group
AUTO_DISPATCH_OPS: set[str] = set()


def _is_view(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@dataclass
class _OpEntry:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor | None]  # refreshed on replay; None: aliased (view / in-place)

    def run(self) -> None:
        flat, _ = tree_flatten(self.func(*self.args, **self.kwargs))
        for item in flat:  # a collective's Work: on the device the stream orders what follows
            if isinstance(item, torch.ScriptObject) and hasattr(item, "wait"):
                item.wait()
        for static, fresh in zip(self.outputs, flat):
            if static is None:
                continue
            if static.shape != fresh.shape:
                raise RuntimeError(
                    f"replay of {self.func._schema.name} produced shape {tuple(fresh.shape)}, "
                    f"captured {tuple(static.shape)}: the captured work depends on host values"
                )
            static.copy_(fresh)


@dataclass
class _EventEntry:
    event: ExternalEvent
    action: str  # "wait" | "reset" | "record"


@dataclass
class TaskGroupHandle:
    """What ``graph_task_group_end`` returns (torch_npu's ``_NPUTaskGroupHandle``)."""

    graph: NPUGraph
    capture_stream: Stream
    entries: list[_OpEntry] = field(default_factory=list)


class ExternalEvent:
    """``torch.npu.ExternalEvent``: ``wait``/``reset``/``record`` on a capturing stream are captured
    into that graph; outside capture ``record`` sets the event (waking parked replays) and
    ``reset`` clears it."""

    def __init__(self) -> None:
        self.recorded = False

    def _captured(self, stream: Stream | None, action: str) -> bool:
        g = runtime.capturing.get(stream or current_stream())
        if g is not None:
            g._entries.append(_EventEntry(self, action))
        return g is not None

    def wait(self, stream: Stream | None = None) -> None:
        if not self._captured(stream, "wait") and not self.recorded:
            raise RuntimeError(
                "ExternalEvent.wait outside a graph on an event never recorded: the "
                "stream would block forever (emulated torch_npu)"
            )

    def reset(self, stream: Stream | None = None) -> None:
        if not self._captured(stream, "reset"):
            self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        if not self._captured(stream, "record"):
            self._set()

    def _set(self) -> None:
        self.recorded = True
        for g in [g for g in runtime.blocked_replays if g._blocked_on is self]:
            runtime.blocked_replays.remove(g)
            g._run(g._resume_at)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, g, name = kwargs or {}, self.graph, func._schema.name
        if name in _HOST_SYNC_OPS:
            raise RuntimeError(
                f"{name} ran under NPU graph capture: it syncs with the host or "
                "sizes its output by tensor values (emulated torch_npu)"
            )
        if g._group is not None and name.split("::")[0] in _COLLECTIVE_NAMESPACES:
            raise RuntimeError(
                f"collective {name} issued inside a graph task group: capture fails with 507009 on "
                "HCCL/AIV; never put a collective inside a task group ("
                "vllm-ascend #13688)"
            )
        if g.auto_dispatch_capture and g._group is None and name in AUTO_DISPATCH_OPS:
            return g._auto_dispatch(func, args, kwargs)
        return g._record(func, args, kwargs)


_pool_ids = itertools.count(1)


def graph_pool_handle() -> tuple[str, int]:
    """An opaque memory-pool token (memory is not pooled in the emulation)."""
    return ("emulated-npu-graph-pool", next(_pool_ids))


class NPUGraph:
    """``torch.npu.NPUGraph``: ``capture_begin(pool=None, capture_error_mode="global")``,
    ``capture_end()``, ``replay()``, ``reset()``, ``pool()``, ``update(cpu_update_input)``."""

    _update_stream: Stream | None = None

    def __init__(self) -> None:
        self.auto_dispatch_capture = False
        self._entries: list[_OpEntry | _EventEntry] = []
        self._records: list[tuple[ExternalEvent, TaskGroupHandle]] = []  # auto-dispatched ops
        self._group: TaskGroupHandle | None = None
        self._mode: _Recorder | None = None
        self._stream: Stream | None = None
        self._captured = False
        self._pool: Any = None
        self._resume_at = 0
        self._blocked_on: ExternalEvent | None = None
        self._replay_stream: Stream | None = None

    # capture --------------------------------------------------------------------------------------
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        s = current_stream()
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(
                f"capture_error_mode must be global, thread_local or relaxed, got "
                f"{capture_error_mode!r}"
            )
        if s is default_stream():
            raise RuntimeError(
                "NPU graphs cannot be captured on the default stream; capture on a "
                "side stream (torch.npu.graph(...) does)"
            )
        if s in runtime.capturing:
            raise RuntimeError(f"{s!r} is already capturing a graph")
        self.reset()
        self._pool, self._stream = pool if pool is not None else graph_pool_handle(), s
        runtime.capturing[s] = self
        self._mode = _Recorder(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        if self._mode is None:
            raise RuntimeError("capture_end without capture_begin")
        group_open = self._group is not None
        self._abort()
        self._captured = True
        if group_open:
            raise RuntimeError("capture ended inside a task group: call graph_task_group_end first")

    def _abort(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        runtime.capturing.pop(self._stream, None)
        self._group = None

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        result = func(*args, **kwargs)
        # by storage, as the CPU reference's recorder: a cast (``to.dtype``, whole under
        # inference mode) is a new tensor a device kernel writes at every replay
        entry = _OpEntry(func, tuple(args), dict(kwargs), fresh_outputs(args, kwargs, result))
        self._entries.append(entry)
        if self._group is not None and not _is_view(func):  # a view launches no device task
            self._group.entries.append(entry)
        return result

    def _auto_dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # what torch_npu's _GraphDispatchMode does for a registered op
        s = current_stream()
        event = ExternalEvent()
        event.wait(s)
        event.reset(s)
        graph_task_group_begin(s)
        result = self._record(func, args, kwargs)
        self._records.append((event, graph_task_group_end(s)))
        return result

    # replay ---------------------------------------------------------------------------------------
    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("replay() before a completed capture")
        if any(g._replay_stream is current_stream() for g in runtime.blocked_replays):
            raise RuntimeError(
                "replay() on a stream where an earlier replay is still blocked on a "
                "captured ExternalEvent.wait nobody recorded: a device would hang "
                "here; update the graph before (or right after) every replay"
            )
        self._replay_stream = current_stream()
        self._run(0)

    def _run(self, position: int) -> None:
        with torch.no_grad():
            for i in range(position, len(self._entries)):
                entry = self._entries[i]
                if isinstance(entry, _OpEntry):
                    entry.run()
                elif entry.action == "wait" and not entry.event.recorded:
                    self._resume_at, self._blocked_on = i, entry.event
                    runtime.blocked_replays.append(self)
                    return
                elif entry.action == "reset":
                    entry.event.recorded = False
                elif entry.action == "record":
                    entry.event._set()

    def reset(self) -> None:
        if self in runtime.blocked_replays:
            runtime.blocked_replays.remove(self)
        if self._mode is not None:
            self._abort()
        self._entries, self._records, self._captured = [], [], False

    def pool(self) -> Any:
        return self._pool

    # automatic update (torch_npu _GraphDispatchMode.update_capture_record) -----------
    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update, Try to "
                "capture by setting auto_dispatch_capture=True during capture"
            )
        inputs = list(cpu_update_input)
        if len(inputs) == 1:
            inputs = [dict(inputs[0]) for _ in self._records]
        if len(inputs) != len(self._records):
            raise RuntimeError(
                f"Currently, there are {len(self._records)} operators that need to "
                f"be updated by capture, and there are only {len(inputs)} elements "
                "in the incoming cpu_update_input list"
            )
        if NPUGraph._update_stream is None:
            NPUGraph._update_stream = Stream()
        for (event, handle), update_input in zip(self._records, inputs):
            (entry,) = handle.entries
            # like torch_npu: only keys the captured call passed are replaced, others are ignored
            kwargs = dict(entry.kwargs)
            kwargs.update(
                {
                    k: list(v) if isinstance(v, (list, tuple)) else v  # copied, as a device
                    for k, v in update_input.items()
                    if k in kwargs
                }
            )  # task holds values
            validate(entry.func, entry.args, kwargs)
            entry.kwargs = kwargs
            event.record(NPUGraph._update_stream)


# task groups (graphs.py: graph_task_group_begin/end); their manual update is in task_update.py
# --------------------------
def graph_task_group_begin(stream: Stream) -> None:
    g = runtime.capturing.get(stream)
    if g is None:
        raise RuntimeError(f"graph_task_group_begin({stream!r}): the stream is not capturing")
    if g._group is not None:
        raise RuntimeError("graph_task_group_begin: a task group is already open on this graph")
    g._group = TaskGroupHandle(g, stream)


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    g = runtime.capturing.get(stream)
    if g is None or g._group is None:
        raise RuntimeError(f"graph_task_group_end({stream!r}) without graph_task_group_begin")
    handle, g._group = g._group, None
    return handle


def check_recordable(op: str) -> None:
    """An op with baked host arguments must be recorded as its own graph entry. Called from inside
    another op's kernel under capture, the emulation could not bake them (a device would), so the
    stale-argument check would silently pass: refuse instead."""
    if is_current_stream_capturing() and not isinstance(_get_current_dispatch_mode(), _Recorder):
        raise RuntimeError(
            f"{op} called inside another op's kernel during NPU graph capture: the emulation can "
            "only bake its host arguments when it is called directly (not from a custom op "
            "wrapping it)"
        )


def is_current_stream_capturing() -> bool:
    return current_stream() in runtime.capturing


class graph:
    """``torch.npu.graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
    capture_error_mode="global")``: synchronizes, then captures on a side stream."""

    default_capture_stream: Stream | None = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Stream | None = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = Stream()
            stream = graph.default_capture_stream
        self.npu_graph, self.pool, self.capture_stream = npu_graph, pool, stream
        self.auto_dispatch_capture = auto_dispatch_capture
        self.capture_error_mode = capture_error_mode
        self._stream_ctx: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> None:
        runtime.synchronize()
        runtime.empty_cache()
        self._stream_ctx = runtime.stream(self.capture_stream)
        self._stream_ctx.__enter__()
        self.npu_graph.auto_dispatch_capture = self.auto_dispatch_capture
        try:
            self.npu_graph.capture_begin(self.pool, self.capture_error_mode)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.npu_graph.capture_end()
            else:
                self.npu_graph._abort()
        finally:
            self._stream_ctx.__exit__(None, None, None)
