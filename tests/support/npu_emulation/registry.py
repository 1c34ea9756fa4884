"""``real_op``: one line per emulated torch_npu op, which then speaks the real API.

    npu_rms_norm = real_op("npu_rms_norm", _rms_norm_cpu)

gives a callable for the emulated ``torch_npu`` module that, on every call,

1. binds the arguments to the op's real schema from the pinned wheel (``real_schema.py``) as
   torch_npu's Python binding does (``binding.py``): a wrong keyword, a missing argument or a value
   of the wrong type (a tensor where the schema has ``SymInt[]``) is a TypeError;
2. calls ``torch.ops.npu_emu.<op>``, defined under that very schema string, whose CPU kernel
3. runs the wheel's meta function for the op (``real_meta.py``) on Meta copies of the arguments:
   whatever it rejects (``torch._check``) is rejected, as the real op's shape inference would;
4. runs ``_rms_norm_cpu`` (the emulation's documented checks and plain-torch numerics), and
5. checks that each output has the shape and dtype the meta function inferred.

Overloads: ``real_op(name, kernel, overloads={"out": out_kernel})`` exposes ``op.out(...)``; an
overload without a meta function of its own (FIA's ``.out``) is checked with the base op's meta
on its inputs (``meta_from=`` names another op whose meta takes the same inputs). ATB ops come with
no meta function in the wheel; they are bound to the schema of their C++ declaration and counted as
"no meta". ``dispatch=`` replaces the plain ``torch.ops`` call (FIA uses it to queue re-issued calls
of a graph update).

Ops are defined lazily, by ``define_all()`` (``install()`` calls it), so that importing the
emulation needs no wheel. Every bind and every meta check is counted in ``COUNTS``; with
``XHAL_NPU_EMULATION_COUNTS=DIR`` each process writes its counts to ``DIR/counts-<pid>.json`` at
exit (how the conformance run and the server report theirs).
"""

from __future__ import annotations

import atexit
import collections
import inspect
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from . import binding
from .real_meta import meta_functions, to_meta
from .real_schema import real_schema

NAMESPACE = "npu_emu"
# op[.overload] -> {"bound": calls bound to the schema, "meta": kernel runs that passed the wheel's
# meta function, "no_meta": kernel runs of ops the wheel has no meta function for}
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_lib: torch.library.Library | None = None
_OPS: list[RealOp] = []

Dispatch = Callable[[Any, tuple, dict], Any]


def _call(op: Any, args: tuple, kwargs: dict) -> Any:
    return op(*args, **kwargs)


class _Overload:
    """One overload: the schema, its ``torch.ops`` handle once defined, the kernel behind it."""

    def __init__(
        self,
        packet: RealOp,
        overload: str,
        kernel: Callable[..., Any],
        meta_from: str | None = None,
    ) -> None:
        self.packet, self.overload, self.kernel = packet, overload, kernel
        self.full_name = packet.name + (f".{overload}" if overload else "")
        self.meta_from = meta_from or packet.name  # whose meta checks this op's inputs
        self.schema: torch._C.FunctionSchema | None = None
        self.op: Any = None

    def define(self, lib: torch.library.Library) -> None:
        text = real_schema(self.full_name)
        self.schema = torch._C.parse_schema(text)
        packet = getattr(torch.ops, NAMESPACE)
        if not hasattr(packet, self.packet.name) or not _has_overload(packet, self):
            lib.define(text)
            lib.impl(self.full_name, self._kernel, "CPU")
        self.op = getattr(getattr(packet, self.packet.name), self.overload or "default")

    def _kernel(self, *args: Any, **kwargs: Any) -> Any:
        metas = meta_functions()
        meta = metas.get(self.full_name)
        base = meta is None and metas.get(self.meta_from)
        if meta is not None or base:
            fn = meta or base
            accepted = inspect.signature(fn).parameters  # the base op's meta: its inputs only
            inputs = {k: v for k, v in kwargs.items() if k in accepted}
            try:
                inferred = fn(*to_meta(args), **to_meta(inputs))
            except (RuntimeError, IndexError, ValueError) as err:  # torch._check, or a bad dim
                raise RuntimeError(
                    f"{self.full_name}: refused by torch_npu's meta function "
                    f"(_meta_registrations.py): {err}"
                ) from err
            COUNTS[self.full_name]["meta"] += 1
        else:
            COUNTS[self.full_name]["no_meta"] += 1
        result = self.kernel(*args, **kwargs)
        if meta is not None:
            _compare(self.full_name, inferred, result)
        _write_counts(force=False)
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.op is None:
            raise RuntimeError(
                f"torch_npu.{self.full_name} is used before the emulation is "
                "installed (npu_emulation.install())"
            )
        bound = binding.bind(self.schema, args, kwargs)
        COUNTS[self.full_name]["bound"] += 1
        positional, keyword = binding.split(self.schema, bound)
        return self.packet.dispatch(self.op, positional, keyword)


def _has_overload(packet: Any, overload: _Overload) -> bool:
    return (overload.overload or "default") in getattr(packet, overload.packet.name).overloads()


def _compare(name: str, inferred: Any, result: Any) -> None:
    want, _ = tree_flatten(inferred)
    got, _ = tree_flatten(result)
    for i, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, torch.Tensor) and (tuple(w.shape) != tuple(g.shape) or w.dtype != g.dtype):
            raise AssertionError(
                f"emulated {name} output {i} is {g.dtype} {tuple(g.shape)}, the wheel's meta "
                f"function infers {w.dtype} {tuple(w.shape)}: the emulation's kernel is wrong"
            )


class RealOp(_Overload):
    """An emulated torch_npu op (its default overload), with ``.<overload>`` attributes."""

    def __init__(
        self,
        name: str,
        kernel: Callable[..., Any],
        overloads: dict[str, Callable[..., Any]] | None = None,
        dispatch: Dispatch = _call,
        meta_from: str | None = None,
    ) -> None:
        self.name, self.dispatch = name, dispatch
        super().__init__(self, "", kernel, meta_from)
        self.overloads = {ov: _Overload(self, ov, k) for ov, k in (overloads or {}).items()}
        for ov, handle in self.overloads.items():
            setattr(self, ov, handle)
        self.__name__ = name


def real_op(
    name: str,
    kernel: Callable[..., Any],
    *,
    overloads: dict[str, Callable[..., Any]] | None = None,
    dispatch: Dispatch = _call,
    meta_from: str | None = None,
) -> RealOp:
    """The emulated ``torch_npu.<name>``: real schema, real meta function, ``kernel`` behind.
    ``meta_from`` names the op whose meta function checks the inputs when ``name`` has none of
    its own (FIA's workspace query takes FIA's arguments)."""
    op = RealOp(name, kernel, overloads, dispatch, meta_from)
    _OPS.append(op)
    return op


def define_all() -> None:
    """Define every ``real_op`` under its wheel schema (needs the wheel; idempotent)."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for op in _OPS:
        for overload in (op, *op.overloads.values()):
            if overload.op is None:
                overload.define(_lib)


_last_write = [0.0]


def _write_counts(force: bool = True) -> None:
    """Save this process's counts when ``XHAL_NPU_EMULATION_COUNTS`` names a directory: at exit,
    and at most once a second while running (a server stopped by a signal skips atexit)."""
    target = os.environ.get("XHAL_NPU_EMULATION_COUNTS")
    now = time.monotonic()
    if not target or not COUNTS or (not force and now - _last_write[0] < 1.0):
        return
    _last_write[0] = now
    path = Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".counts-{os.getpid()}.tmp"
    tmp.write_text(json.dumps({k: dict(v) for k, v in COUNTS.items()}, indent=1, sort_keys=True))
    os.replace(tmp, path / f"counts-{os.getpid()}.json")


def read_counts(path: Path) -> dict[str, collections.Counter]:
    """The counts every process wrote under ``path``, summed per op."""
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for f in sorted(Path(path).glob("counts-*.json")):
        for op, c in json.loads(f.read_text()).items():
            total[op].update(c)
    return dict(total)


atexit.register(_write_counts)
