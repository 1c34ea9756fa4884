"""The platform registry: built-ins, entry-point plugins (group ``xhal.platforms``) and
``XHAL_PLUGINS`` modules, all imported lazily."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from xhal import env
from xhal.platforms.registry import Registry, lazy

if TYPE_CHECKING:
    from xhal.interfaces.platform import Platform

ENTRY_POINT_GROUP = "xhal.platforms"

# name -> zero-argument loader returning the Platform class (or a factory returning an instance)
_loaders: Registry[Callable[[], object]] = Registry("platform")
_instances: dict[str, Platform] = {}  # in creation order
_plugins_loaded = False
# called with each platform created (``xhal.ops`` registers its kernels and ops this way, so the
# registry never imports the ops: they sit above it)
_on_create: list[Callable[[Platform], None]] = []

_BUILTINS = {
    "cpu": "xhal.platforms.cpu_ref.platform:CpuPlatform",
    "cpu-fast": "xhal.platforms.cpu_fast.platform:CpuFastPlatform",
    "cuda": "xhal.platforms.cuda.platform:CudaPlatform",
    "cuda-triton": "xhal.platforms.cuda.platform:CudaTritonPlatform",
    "cuda-tilelang": "xhal.platforms.cuda.tilelang_platform:CudaTileLangPlatform",
    "npu": "xhal.platforms.npu.platform:NpuPlatform",
}
for _name, _target in _BUILTINS.items():
    _loaders.register(_name, lazy(_target))


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _loaders:
            _loaders.register(ep.name, ep.load)
    for module in env.plugins():
        importlib.import_module(module)


def register(
    name: str, platform: type[Platform] | Callable[[], Platform] | str, *, replace: bool = False
):
    """Register a platform class, a factory, or a lazy ``"module:Class"`` target under ``name``."""
    loader = lazy(platform) if isinstance(platform, str) else (lambda: platform)
    _loaders.register(name, loader, replace=replace)
    _instances.pop(name, None)
    return platform


def unregister(name: str) -> None:
    _loaders.unregister(name)
    _instances.pop(name, None)


def names() -> list[str]:
    """Every registered platform name, available here or not."""
    _load_plugins()
    return _loaders.names()


def platform_class(name: str) -> type[Platform] | Callable[[], Platform]:
    _load_plugins()
    return _loaders.get(name)()  # type: ignore[return-value]


def get(name: str) -> Platform:
    """The platform instance for ``name`` (created once per process).

    Raises ``KeyError`` listing the known names for an unknown one, and the platform's own
    error (naming the missing package) when it cannot be created here.
    """
    if name not in _instances:
        cls = platform_class(name)
        _check_interface_version(name, cls)
        platform = _instances[name] = cls()  # type: ignore[call-arg]
        for listener in _on_create:
            listener(platform)
    return _instances[name]


def on_create(listener: Callable[[Platform], None]) -> None:
    """Call ``listener`` with every platform ``get`` has created (in creation order) and, from
    now on, with each new one as it is created."""
    _on_create.append(listener)
    for platform in list(_instances.values()):
        listener(platform)


def _check_interface_version(name: str, cls: object) -> None:
    from xhal.interfaces.platform import INTERFACE_VERSION

    version = getattr(cls, "interface_version", INTERFACE_VERSION)  # factories: not stated
    if version != INTERFACE_VERSION:
        raise RuntimeError(
            f"platform {name!r} was written for xhal interface version {version}, this xhal "
            f"implements version {INTERFACE_VERSION}: install a release of the plugin built for "
            f"version {INTERFACE_VERSION} (see docs/writing-a-backend.md, 'Versions')"
        )


def available() -> list[str]:
    """Names of the platforms that can run on this machine (never raises)."""
    out = []
    for name in names():
        try:
            cls = platform_class(name)
            ok = bool(cls.is_available()) if hasattr(cls, "is_available") else True
        except Exception:
            ok = False
        if ok:
            out.append(name)
    return out
