"""xhal: a hardware-abstraction layer for running LLMs from Python.

``import xhal`` is cheap and device-free; backends import their libraries when created.
"""

from xhal import platforms
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
