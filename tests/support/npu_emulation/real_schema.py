"""The real schema strings of torch_npu's ops, read from the pinned wheel (``wheel.py``).

Aten-style ops come from ``npu_native_functions_by_codegen.yaml`` (one ``func:`` line each, the
exact text torch_npu's codegen compiles). The ATB ops the backend may fall back to are not in
that file; their schema is derived from the C++ declaration in ``AtbOpsInterface.h`` by the
codegen's own type mapping (``const at::Tensor&`` -> ``Tensor``, a mutable ``at::Tensor&`` ->
``Tensor(a!)``, ``int64_t`` -> ``int``, ``double`` -> ``float``, ``void`` -> ``()``).
"""

from __future__ import annotations

import functools
import re
import string

from .wheel import wheel_files

_FUNC = re.compile(r"^\s*(?:-\s*)?func:\s*(.+?)\s*$")


@functools.cache
def yaml_schemas() -> dict[str, str]:
    """``"name[.overload]" -> schema`` for every ``func:`` line of the wheel's YAML."""
    schemas: dict[str, str] = {}
    for line in wheel_files().yaml.read_text(encoding="utf-8").splitlines():
        m = _FUNC.match(line)
        if m:
            text = m.group(1)
            schemas.setdefault(text.split("(", 1)[0], text)  # the YAML lists some ops twice
    return schemas


_CPP_TYPES = {
    "const at::Tensor&": "Tensor", "const at::Tensor &": "Tensor", "int64_t": "int",
    "double": "float", "bool": "bool", "c10::SymIntArrayRef": "SymInt[]",
    "at::IntArrayRef": "int[]", "const c10::optional<at::Tensor>&": "Tensor?",
    "const c10::optional<at::Tensor> &": "Tensor?", "c10::optional<c10::string_view>": "str?",
    "const int64_t": "int", "const double": "float",
}


@functools.cache
def atb_schemas() -> dict[str, str]:
    """``name -> schema`` for the ``TORCH_NPU_API`` declarations of ``AtbOpsInterface.h``."""
    header = wheel_files().atb_header.read_text(encoding="utf-8")
    schemas: dict[str, str] = {}
    decl = re.compile(r"TORCH_NPU_API\s+(.+?)\s+(\w+)\((.*?)\);")
    for ret, name, params in decl.findall(header):
        try:
            schemas[name] = _schema_from_cpp(name, ret, params)
        except KeyError:
            continue  # a C++ type the mapping does not cover: not an op this emulation uses
    return schemas


def _schema_from_cpp(name: str, ret: str, params: str) -> str:
    aliases = iter(string.ascii_lowercase)
    args = []
    for param in filter(None, (p.strip() for p in params.split(","))):
        m = re.match(r"(.*?[&\s])\s*(\w+)$", param)
        cpp_type, arg = re.sub(r"\s+", " ", m.group(1)).strip(), m.group(2)
        if cpp_type in ("at::Tensor&", "at::Tensor &"):
            args.append(f"Tensor({next(aliases)}!) {arg}")  # written in place
        else:
            args.append(f"{_CPP_TYPES[cpp_type]} {arg}")
    if ret != "void":
        raise KeyError(ret)  # the ATB ops used here return nothing; others are not mapped
    return f"{name}({', '.join(args)}) -> ()"


def real_schema(name: str) -> str:
    """The wheel's schema for ``name`` (``"op"`` or ``"op.overload"``), YAML first, then ATB."""
    found = yaml_schemas().get(name) or atb_schemas().get(name)
    if found is None:
        raise KeyError(f"torch_npu {name!r} is in neither npu_native_functions_by_codegen.yaml nor "
                       "AtbOpsInterface.h of the pinned wheel: the backend may not call it")
    return found
