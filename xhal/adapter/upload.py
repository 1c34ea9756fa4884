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
    device = torch.device(device)
    # page-locked for a device, so the copy is asynchronous and the host can go on building the
    # next step while the device still runs this one; torch's caching host allocator does not hand
    # the buffer out again before the copy has completed
    pinned = device.type not in ("cpu", "meta")
    packed = torch.zeros(max(total, 1), dtype=torch.int32, pin_memory=pinned)
    for name, t in host.items():
        packed[offsets[name] : offsets[name] + t.numel()] = t.reshape(-1)
    on_device = packed.to(device, non_blocking=pinned)
    return {
        name: on_device[offsets[name] : offsets[name] + t.numel()].view(t.shape)
        for name, t in host.items()
    }
