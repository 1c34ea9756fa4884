"""xhal: a hardware-abstraction layer for running LLMs from Python.

``import xhal`` is cheap and device-free: it imports neither torch nor a backend. The interface
types are imported on first use (``xhal.Platform``), backends when created, so a command line
built on xhal (``xhal-align --help``) answers before anything heavy loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from xhal import platforms

if TYPE_CHECKING:
    from xhal.interfaces import (
        AttentionBackend,
        AttentionMetadata,
        AttentionSpec,
        BatchKind,
        Collective,
        DeviceOps,
        GraphRunner,
        LayerCache,
        Platform,
    )

__version__ = "0.1.0"

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "BatchKind",
    "Collective",
    "DeviceOps",
    "GraphRunner",
    "LayerCache",
    "Platform",
    "platforms",
]
_INTERFACES = frozenset(__all__) - {"platforms"}


def __getattr__(name: str) -> Any:
    # PEP 562: the interfaces and the ops (and with them torch) load on first access
    if name in _INTERFACES:
        return getattr(importlib.import_module("xhal.interfaces"), name)
    if name == "ops":
        return importlib.import_module("xhal.ops")
    raise AttributeError(f"module 'xhal' has no attribute {name!r}")
