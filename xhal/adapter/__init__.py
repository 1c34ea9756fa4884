"""C++-compatible metadata input: xLLM's ``PyAttentionMetadataView`` layout (``"npu"`` or ``"cuda"``
convention) <-> xhal's normalized ``AttentionMetadata``.

``from_xllm`` is what an executor calls on the host's per-step metadata; ``to_xllm`` is what a
Python host (the reference server's input builder) uses to emit exactly the C++ layout.
``header_path()`` is the C header that documents the same contract for C/C++ hosts.
"""

from __future__ import annotations

from pathlib import Path

from xhal.adapter.conventions import CONVENTIONS, Convention
from xhal.adapter.fields import FIELDS
from xhal.adapter.from_xllm import from_xllm
from xhal.adapter.kind import derive_kind
from xhal.adapter.to_xllm import to_xllm


def header_path() -> Path:
    """Path of ``xhal_metadata.h``, the C/C++ description of the metadata contract."""
    return Path(__file__).with_name("xhal_metadata.h")


__all__ = [
    "CONVENTIONS",
    "FIELDS",
    "Convention",
    "derive_kind",
    "from_xllm",
    "header_path",
    "to_xllm",
]
