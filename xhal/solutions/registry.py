"""The registry of solutions, keyed by op: the built-in backends' declarations, the
``xhal.solutions`` entry-point group for out-of-tree packages, and ``register`` for anyone.

Declarations are data and import no kernel, so loading them all is cheap and safe anywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

from xhal import env
from xhal.solutions.op_names import OPS
from xhal.solutions.solution import Solution

ENTRY_POINT_GROUP = "xhal.solutions"
# each module holds ``SOLUTIONS``, a tuple of Solution records
_BUILTIN_MODULES = (
    "xhal.platforms.cpu_ref.solutions",
    "xhal.platforms.cpu_fast.solutions",
    "xhal.platforms.cuda.solutions", "xhal.platforms.npu.solutions")

_by_op: dict[str, list[Solution]] = {op: [] for op in OPS}
_loaded = False


def _identity(s: Solution) -> tuple[str, str, str | None]:
    return s.op, s.name, s.requires.device_type


def register(solution: Solution, *, replace: bool = False) -> Solution:
    """Add a solution; a second one with the same op, name and device type raises unless
    ``replace``. Returns the solution."""
    _load()
    entries = _by_op[solution.op]
    same = [i for i, s in enumerate(entries) if _identity(s) == _identity(solution)]
    if same and not replace:
        raise ValueError(
            f"solution {solution.key} for device {solution.requires.device_type!r} is already "
            "registered (pass replace=True to swap it)"
        )
    for i in reversed(same):
        del entries[i]
    entries.append(solution)
    return solution


def unregister(solution: Solution) -> None:
    entries = _by_op[solution.op]
    entries[:] = [s for s in entries if _identity(s) != _identity(solution)]


def solutions(op: str, device_type: str | None = None) -> list[Solution]:
    """The solutions of ``op`` (for one device type when given), highest priority first."""
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}; ops with solutions: {', '.join(OPS)}")
    _load()
    found = [
        s for s in _by_op[op]
        if device_type is None or s.requires.device_type in (None, device_type)
    ]
    return sorted(found, key=lambda s: -s.priority)


def _add_all(items: Iterable[Solution], origin: str) -> None:
    for item in items:
        if not isinstance(item, Solution):
            raise TypeError(f"{origin} gave {item!r}, not an xhal.solutions.Solution")
        register(item)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        _add_all(importlib.import_module(module).SOLUTIONS, module)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        # an entry point names a sequence of solutions or a function returning one
        value: Iterable[Solution] | Callable[[], Iterable[Solution]] = ep.load()
        _add_all(value() if callable(value) else value, f"entry point {ep.name!r} ({ep.value})")
    for module in env.plugins():  # a plugin module may call register() when imported
        importlib.import_module(module)
