"""Bind a Python call to a real torch_npu schema as torch_npu's generated Python bindings do
(PythonArgParser): positional arguments up to the ``*``, keywords by their schema names, the
outputs of an ``.out`` overload as one ``out=`` (a list when there are several), and each value
checked against the argument's declared type. ``torch.ops`` alone is laxer (it takes a tensor for
``SymInt[]``), so the check is done here, with the binding's wording.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch

_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or (
        not isinstance(v, (bool, torch.Tensor, float)) and hasattr(v, "__index__"))


def _kind(v: Any) -> str:
    return "Tensor" if isinstance(v, torch.Tensor) else type(v).__name__


def _declared(schema: torch._C.FunctionSchema, name: str) -> str:
    """The type as the schema text spells it (the parsed type says ``int`` for ``SymInt``)."""
    m = re.search(r"([\w\[\]?()!]+) " + re.escape(name) + r"\b", str(schema))
    return m.group(1) if m else "?"


def _check(op: str, arg: torch._C.Argument, value: Any, declared: str = "") -> Any:
    """``value`` converted as the binding converts it, or a TypeError in its words."""
    t = str(arg.type)
    optional = t.startswith("Optional[")
    if optional:
        if value is None:
            return None
        t = t[len("Optional["):-1]
    where = f"{op}(): argument '{arg.name}'"
    if t == "Tensor":
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} must be Tensor, not {_kind(value)}")
        return value
    if t == "List[Tensor]":  # `Tensor[]`: a list or tuple of tensors, never one bare tensor
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, torch.Tensor) for v in value):
            bad = _kind(value) if not isinstance(value, (list, tuple)) else "a list holding " + (
                ", ".join(sorted({_kind(v) for v in value if not isinstance(v, torch.Tensor)})))
            raise TypeError(f"{where} must be tuple of Tensors, not {bad} (the schema declares "
                            f"{declared or t})")
        return list(value)
    if t in ("List[int]", "List[SymInt]"):
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
            bad = _kind(value) if not isinstance(value, (list, tuple)) else "a list holding " + (
                ", ".join(sorted({_kind(v) for v in value if not _is_int(v)})))
            raise TypeError(
                f"{where} must be tuple of ints, not {bad}: the schema declares "
                f"{declared or t}, host integers the call carries "
                "itself (a graph bakes them at capture)"
            )
        return [operator.index(v) for v in value]
    if t in ("int", "SymInt"):
        if not _is_int(value):
            raise TypeError(f"{where} must be int, not {_kind(value)}")
        return operator.index(value)
    if t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be float, not {_kind(value)}")
        return float(value)
    if t == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be bool, not {_kind(value)}")
        return value
    if t == "str":
        if not isinstance(value, str):
            raise TypeError(f"{where} must be str, not {_kind(value)}")
        return value
    raise NotImplementedError(f"{where}: the emulation's binder has no rule for type {t}")


def bind(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{argument name: checked value}`` for every argument the call sets (defaults left out),
    or a TypeError naming the wrong argument as torch_npu's binding would."""
    op = schema.name.split("::")[-1] + (f".{schema.overload_name}" if schema.overload_name else "")
    kwargs = dict(kwargs)
    outs = [a for a in schema.arguments if a.is_out]
    ins = [a for a in schema.arguments if not a.is_out]
    positional = [a for a in ins if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}() takes {len(positional)} positional arguments but {len(args)} "
                        "were given; the rest are keyword-only in the schema")
    bound: dict[str, Any] = {}
    for arg, value in zip(positional, args):
        bound[arg.name] = value
    if outs:
        out = kwargs.pop("out", _MISSING)
        if out is _MISSING:
            raise TypeError(f"{op}() missing required keyword 'out' ({len(outs)} tensors: "
                            f"{', '.join(a.name for a in outs)})")
        out = [out] if isinstance(out, torch.Tensor) and len(outs) == 1 else out
        if not isinstance(out, (list, tuple)) or len(out) != len(outs):
            raise TypeError(f"{op}(): argument 'out' must be a list of {len(outs)} tensors "
                            f"({', '.join(a.name for a in outs)}), not {_kind(out)}")
        bound.update(zip((a.name for a in outs), out))
    names = {a.name for a in ins}
    for name, value in kwargs.items():
        if name not in names:
            raise TypeError(f"{op}() got an unexpected keyword argument '{name}'")
        if name in bound:
            raise TypeError(f"{op}() got multiple values for argument '{name}'")
        bound[name] = value
    for arg in schema.arguments:
        if arg.name not in bound:
            if arg.default_value is None and not str(arg.type).startswith("Optional["):
                raise TypeError(f"{op}() missing required argument '{arg.name}'")
            continue
        bound[arg.name] = _check(op, arg, bound[arg.name], _declared(schema, arg.name))
    return bound


def split(schema: torch._C.FunctionSchema, bound: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``bound`` as ``(positional, keyword)`` in the schema's own order, for ``torch.ops``."""
    positional: list[Any] = []
    keyword: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if a.name not in bound:
            continue
        # positional only while every positional argument before it is present
        if not a.kwarg_only and not a.is_out and len(positional) == i:
            positional.append(bound[a.name])
        else:
            keyword[a.name] = bound[a.name]
    return tuple(positional), keyword
