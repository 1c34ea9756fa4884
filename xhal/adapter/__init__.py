"""C++-compatible metadata input: xLLM's ``PyAttentionMetadataView`` layout (``"npu"`` or ``"cuda"``
convention) <-> xhal's normalized ``AttentionMetadata``.

``xhal.adapter.from_xllm.from_xllm`` is what an executor calls on the host's per-step metadata;
``xhal.adapter.to_xllm.to_xllm`` is what a Python host (the reference server's input builder)
uses to emit exactly the C++ layout. ``header_path()`` is the C header that documents the same
contract for C/C++ hosts.

The package hands on only names that are no submodule's: ``import xhal.adapter.to_xllm`` gives
the module, and the two functions are imported from their modules.
"""

from __future__ import annotations

from pathlib import Path

from xhal.adapter.conventions import CONVENTIONS, Convention
from xhal.adapter.fields import FIELDS
from xhal.adapter.kind import derive_kind


def header_path() -> Path:
    """Path of ``xhal_metadata.h``, the C/C++ description of the metadata contract."""
    return Path(__file__).with_name("xhal_metadata.h")


__all__ = [
    "CONVENTIONS",
    "FIELDS",
    "Convention",
    "derive_kind",
    "header_path",
]
