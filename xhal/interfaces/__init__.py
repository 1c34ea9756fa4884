"""The contracts between hardware-neutral code and device backends: ABCs and dataclasses only."""

from xhal.interfaces.attention import AttentionBackend, AttentionBlock, AttentionSpec
from xhal.interfaces.cache import LayerCache, normalize_layer_caches
from xhal.interfaces.collective import Collective
from xhal.interfaces.graph import GraphRunner
from xhal.interfaces.metadata import AttentionMetadata, BatchKind
from xhal.interfaces.ops import DeviceOps
from xhal.interfaces.platform import (
    INTERFACE_VERSION,
    AttentionCapabilities,
    Capabilities,
    Platform,
)

__all__ = [
    "INTERFACE_VERSION",
    "AttentionBackend",
    "AttentionBlock",
    "AttentionCapabilities",
    "AttentionMetadata",
    "AttentionSpec",
    "BatchKind",
    "Capabilities",
    "Collective",
    "DeviceOps",
    "GraphRunner",
    "LayerCache",
    "Platform",
    "normalize_layer_caches",
]
