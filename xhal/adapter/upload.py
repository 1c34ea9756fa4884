"""Move a step's derived int32 host tensors to the device in one transfer."""

from __future__ import annotations

import torch

# Each tensor starts on a 64-byte boundary of the packed buffer (16 int32), so kernels that
# vectorize their loads see the alignment a separately allocated tensor would have.
_ALIGN = 16


def upload(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy int32 CPU tensors to ``device`` as views of one packed buffer: one host-to-device copy
    per step instead of one per field. Returns the views by the same names."""
    if not host:
        return {}
    offsets: dict[str, int] = {}
    total = 0
    for name, t in host.items():
        offsets[name] = total
        total += -(-t.numel() // _ALIGN) * _ALIGN
    packed = torch.zeros(max(total, 1), dtype=torch.int32)
    for name, t in host.items():
        packed[offsets[name] : offsets[name] + t.numel()] = t.reshape(-1)
    on_device = packed.to(device)
    return {
        name: on_device[offsets[name] : offsets[name] + t.numel()].view(t.shape)
        for name, t in host.items()
    }
