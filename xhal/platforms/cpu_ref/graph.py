"""A reference GraphRunner that behaves like a device graph.

Capture runs the function once under a ``TorchDispatchMode`` that records every tensor op with
the very tensors it touched. Replay re-executes exactly those ops on those tensors: in-place ops
mutate as before, view ops keep aliasing, and out-of-place results are copied into the tensors
captured as outputs (so ops downstream, and the caller, see them). Python-side values are baked at
capture, exactly as on a device; an op whose result changes shape on replay, or a host sync under
capture, is an error, as it would be on a device.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from xhal.interfaces.graph import GraphRunner

# ops that read tensor values on the host or size outputs by them: illegal under device capture
_HOST_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item"}


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor | None]  # tensors to refresh on replay (None: aliased, skip)


@dataclass
class _Eager:
    """A ``split`` point: ``fn`` runs again at replay, its result copied into ``output``."""

    fn: Callable[[], torch.Tensor]
    output: torch.Tensor


def fresh_outputs(args: tuple, kwargs: dict, result: Any) -> list[torch.Tensor | None]:
    """The flattened ``result`` of one recorded op with None for every tensor that aliases an
    input (a view, the argument of an in-place or ``out=`` op): what a replay must copy its fresh
    results into. Decided by storage, not by the schema: a "may alias" op (``to``, ``reshape``,
    ``contiguous``: ``Tensor(a)``) returns a new tensor when it converts or copies, and under
    ``torch.inference_mode`` such composite ops reach the recorder whole instead of as their
    decomposition, so a schema rule would leave a dtype cast's output stale at every replay."""
    inputs, _ = tree_flatten((args, kwargs))
    storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    flat, _ = tree_flatten(result)
    return [
        t
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages
        else None
        for t in flat
    ]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in _HOST_SYNC_OPS:
            raise RuntimeError(
                f"{func._schema.name} ran under graph capture: it syncs with the host or sizes its "
                "output by tensor values, which a device graph cannot capture"
            )
        result = func(*args, **kwargs)
        self.ops.append(_Op(func, args, kwargs, fresh_outputs(args, kwargs, result)))
        return result


@dataclass
class _Graph:
    ops: list[_Op | _Eager]
    outputs: Any

    def replay(self) -> Any:
        for op in self.ops:
            if isinstance(op, _Eager):
                op.output.copy_(op.fn())
                continue
            flat, _ = tree_flatten(op.func(*op.args, **op.kwargs))
            for item in flat:  # a collective returns its Work: the caller waited on it at capture
                if isinstance(item, torch.ScriptObject) and hasattr(item, "wait"):
                    item.wait()
            for static, fresh in zip(op.outputs, flat):
                if static is None:
                    continue
                if static.shape != fresh.shape:
                    raise RuntimeError(
                        f"replay of {op.func._schema.name} produced shape {tuple(fresh.shape)}, "
                        f"captured {tuple(static.shape)}: the captured work depends on host values"
                    )
                static.copy_(fresh)
        return self.outputs


class CpuGraphRunner(GraphRunner):
    def __init__(self) -> None:
        self._graphs: dict[Hashable, _Graph] = {}
        self._recorder: _Recorder | None = None

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        self._recorder = _Recorder()
        try:
            with torch.no_grad(), self._recorder:
                outputs = fn()
        finally:
            ops, self._recorder = self._recorder.ops, None
        self._graphs[key] = _Graph(ops, outputs)
        return outputs

    def split(self, fn: Callable[[], Any]) -> Any:
        recorder = self._recorder
        if recorder is None:
            return fn()
        recorder.__exit__(None, None, None)  # fn runs outside the recording, as it will at replay
        try:
            output = fn()
        finally:
            recorder.__enter__()
        recorder.ops.append(_Eager(fn, output))
        return output

    def replay(self, key: Hashable) -> Any:
        if key not in self._graphs:
            raise KeyError(f"no graph captured for key {key!r}; captured: {list(self._graphs)}")
        with torch.no_grad():
            return self._graphs[key].replay()

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def reset(self) -> None:
        self._graphs.clear()
