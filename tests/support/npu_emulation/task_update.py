"""The manual task-group update protocol (``graphs.py`` of the wheel, as vllm-ascend uses it):
``graph_task_update_begin(stream, handle)``, ops re-issued on ``stream`` (queued, not run),
``graph_task_update_end(stream)`` replaces the arguments of the group's recorded entries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import runtime
from .runtime import Stream, current_stream

if TYPE_CHECKING:
    from .graph import TaskGroupHandle

# filled by fia.py: update-time checks of a re-issued op, by op name
UPDATE_VALIDATORS: dict[str, Callable[[tuple, dict], None]] = {}


@dataclass
class _UpdateSession:
    stream: Stream
    handle: TaskGroupHandle
    reissued: list[tuple[Any, tuple, dict]] = field(default_factory=list)


_session: _UpdateSession | None = None


def graph_task_update_begin(stream: Stream, handle: TaskGroupHandle) -> None:
    global _session
    from .graph import TaskGroupHandle  # graph.py imports this module

    if not isinstance(handle, TaskGroupHandle):
        raise TypeError(
            f"graph_task_update_begin: handle must come from graph_task_group_end, "
            f"got {type(handle).__name__}"
        )
    if _session is not None:
        raise RuntimeError("graph_task_update_begin: an update is already open")
    if stream is handle.capture_stream:
        raise RuntimeError(
            "graph_task_update_begin: the update stream must differ from the capture stream"
        )
    if stream in runtime.capturing:
        raise RuntimeError("graph_task_update_begin on a capturing stream")
    _session = _UpdateSession(stream, handle)


def graph_task_update_end(stream: Stream) -> None:
    global _session
    session, _session = _session, None
    if session is None or session.stream is not stream:
        raise RuntimeError(f"graph_task_update_end({stream!r}) without a matching update_begin")
    captured = session.handle.entries
    same = len(session.reissued) == len(captured) and all(
        str(func) == str(entry.func) for (func, _, _), entry in zip(session.reissued, captured)
    )
    if not same:
        raise RuntimeError(
            f"graph_task_update_end: the task group holds {[str(e.func) for e in captured]}, but "
            f"{[str(f) for f, _, _ in session.reissued]} were re-issued on the update stream; "
            "re-issue the same ops, inside `with torch.npu.stream(update_stream):` (emulated)"
        )
    for (_, args, kwargs), entry in zip(session.reissued, captured):
        entry.args, entry.kwargs = tuple(args), dict(kwargs)


def updating() -> bool:
    """Whether an op issued now is a re-issue for ``graph_task_update_begin/end``."""
    return _session is not None and current_stream() is _session.stream


def reissue(func: Any, args: tuple, kwargs: dict) -> None:
    """Called by an op wrapper while ``updating()``: validate and queue instead of running."""
    assert _session is not None
    validate(func, args, kwargs)
    _session.reissued.append((func, args, kwargs))


def validate(func: Any, args: tuple, kwargs: dict) -> None:
    validator = UPDATE_VALIDATORS.get(func._schema.name)
    if validator is not None:
        validator(args, kwargs)


def reset() -> None:
    """Drop an update left open (by an exception between begin and end)."""
    global _session
    _session = None
