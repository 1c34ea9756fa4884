"""A step handed on the host, moved to the device in one copy for the runners that need it there.

A host may build a step's int32 tensors in host memory and hand them to ``execute`` as they are:
the decode graphs stage such a step in one pinned copy of their own (``packed_inputs.py``); the
eager and piecewise runners need device tensors, which this module makes with one packed upload
(``xhal.adapter.upload``) rather than a copy per field.
"""

from __future__ import annotations

import dataclasses

import torch

from xhal.interfaces.metadata import AttentionMetadata

# the metadata's device-side fields (ARCHITECTURE.md section 2); the *_host twins stay on the host
_DEVICE_FIELDS = (
    "q_cu_seq_lens", "kv_cu_seq_lens", "q_seq_lens", "kv_seq_lens", "block_table",
    "slot_mapping", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
)  # fmt: skip


def on_device(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step with every host tensor of it on ``device``: int32 ones in one packed copy, any
    other dtype by a copy of its own; tensors already there are kept as they are."""
    if device.type == "cpu":
        return input_ids, positions, metadata
    tensors = {"input_ids": input_ids, "positions": positions}
    tensors |= {name: getattr(metadata, name) for name in _DEVICE_FIELDS}
    host = {
        name: t
        for name, t in tensors.items()
        if t is not None and t.device.type == "cpu" and t.dtype == torch.int32
    }
    if not host:
        return input_ids, positions, metadata
    from xhal.adapter.upload import upload

    moved = upload({name: t.contiguous() for name, t in host.items()}, device)
    for name, t in tensors.items():
        if name not in moved and t is not None and t.device != device:
            moved[name] = t.to(device)
    fields = {name: moved[name] for name in _DEVICE_FIELDS if name in moved}
    return (
        moved.get("input_ids", input_ids),
        moved.get("positions", positions),
        dataclasses.replace(metadata, **fields) if fields else metadata,
    )
