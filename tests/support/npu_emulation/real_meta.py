"""The real shape and dtype functions of torch_npu's ops: the wheel's ``_meta_registrations.py``,
executed here without torch_npu.

The file registers each function with ``@impl(Library("npu", "IMPL", "Meta"), name)``. It is run
with its own globals, in which a few imports resolve to small stand-ins instead of torch_npu:

* ``torch.library.Library`` / ``impl`` collect the functions by op name into ``META`` (nothing is
  registered with torch; the ``aten`` overrides in the file are collected and never used);
* ``torch_npu.utils._error_code`` gives ``ErrCode`` / ``ops_error`` (error-code suffixes);
* ``get_soc_version()`` answers ``SOC_VERSION`` (Ascend910B1, an Atlas A2 training / 800I A2
  part) and ``get_cann_version()`` ``CANN_VERSION``; the file only compares them against
  "8.5.0.alpha003", "9.2.0" and SoC 260 (Ascend 950), in ops the backend never calls;
* ``torch`` is torch itself except ``torch.ops.npu.<op>.default``, which the file names at import
  time for ``has_side_effect`` (a no-op here): those ops exist only in the real torch_npu.
"""

from __future__ import annotations

import builtins
import functools
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOC_VERSION = 220  # torch_npu's SocVersion for Ascend910B1 (Atlas A2); Ascend950 is 260
CANN_VERSION = "8.5.0"  # the CANN release documented alongside torch-npu 2.14.0's op-plugin


class _ErrCodeMeta(type):
    def __getattr__(cls, name: str) -> str:
        return name


class ErrCode(metaclass=_ErrCodeMeta):
    """``ErrCode.VALUE`` etc.: only ever formatted into a message."""


def ops_error(code: Any) -> str:
    return f"\n[ERROR] OPS {code} (torch_npu meta function, run by xhal's emulation)"


class _Library:
    def __init__(self, ns: str, kind: str, dispatch_key: str = "") -> None:
        self.ns = ns


class _Collector:
    def __init__(self) -> None:
        self.functions: dict[str, Callable[..., Any]] = {}

    def impl(self, lib: _Library, name: str, *args: Any, **kwargs: Any):
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            if lib.ns == "npu":
                self.functions[name] = fn
            return fn

        return register


class _AnyOp:
    """``torch.ops.npu.<op>.default`` at import time: a name, no op behind it."""

    def __getattr__(self, name: str) -> _AnyOp:
        return self


class _TorchView(types.ModuleType):
    """torch for the meta file: everything forwards to torch, ``ops.npu`` is ``_AnyOp``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.ops = types.SimpleNamespace(npu=_AnyOp())

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _TorchNpuStub(types.ModuleType):
    """``torch_npu``: its dtype names (``torch_npu.hifloat8``...) are distinct sentinels that equal
    nothing real, and ``torch_npu.npu.utils`` answers version queries from the constants above."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        utils = types.SimpleNamespace(
            get_cann_version=lambda module="CANN": CANN_VERSION,
            _is_gte_cann_version=lambda version, module="CANN": CANN_VERSION >= version,
        )
        self.npu = types.SimpleNamespace(
            utils=utils, _backends=types.SimpleNamespace(get_soc_version=lambda: SOC_VERSION)
        )

    def __getattr__(self, name: str) -> Any:
        sentinel = object()
        setattr(self, name, sentinel)
        return sentinel


def _stub_modules(collector: _Collector) -> dict[str, Any]:
    npu = _TorchNpuStub()
    return {
        "torch": _TorchView(),
        "torch_npu": npu,
        "torch.library": types.SimpleNamespace(Library=_Library, impl=collector.impl),
        "torch.fx.node": types.SimpleNamespace(has_side_effect=lambda op: None),
        "torch_npu.utils._error_code": types.SimpleNamespace(ErrCode=ErrCode, ops_error=ops_error),
        "torch_npu.npu.utils": npu.npu.utils,
        "torch_npu.npu._backends": npu.npu._backends,
    }


def load_meta_file(path: Any) -> dict[str, Callable[..., Any]]:
    """Run one ``*_meta_registrations.py`` of the wheel; ``op name -> meta function``."""
    collector = _Collector()
    stubs = _stub_modules(collector)

    def import_(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name in stubs:
            if not fromlist and "." in name:  # `import a.b` binds `a`
                return stubs[name.split(".")[0]]
            return stubs[name]
        if level == 0 and name.split(".")[0] == "torch_npu":
            raise ImportError(f"the emulation's stand-in has no {name!r}")
        return builtins.__import__(name, globals, locals, fromlist, level)

    env_builtins = dict(vars(builtins), __import__=import_)
    source = Path(path).read_text(encoding="utf-8")
    code = compile(source, str(path), "exec")
    # the wheel's own file, run in globals of its own: the point is to execute Ascend's code
    exec(code, {"__name__": "torch_npu_meta_registrations", "__builtins__": env_builtins})  # noqa: S102
    return collector.functions


@functools.cache
def meta_functions() -> dict[str, Callable[..., Any]]:
    """Every meta function of the pinned wheel (aten-style ops and ATB ops)."""
    from .wheel import wheel_files

    files = wheel_files()
    return {**load_meta_file(files.atb_meta), **load_meta_file(files.meta)}


def to_meta(value: Any) -> Any:
    """Tensors (also inside lists) as Meta tensors of the same shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    return value
