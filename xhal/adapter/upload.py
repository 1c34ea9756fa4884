"""Move a step's int32 host arrays to the device in one transfer."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

# Each array starts on a 64-byte boundary of the packed buffer (16 int32), so kernels that
# vectorize their loads see the alignment a separately allocated tensor would have.
_ALIGN = 16


def upload(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy int32 CPU tensors to ``device`` as views of one packed buffer: one host-to-device copy
    per step instead of one per field. Returns the views by the same names."""
    return upload_packed({name: t.numpy() for name, t in host.items()}, device)


def upload_packed(host: Mapping[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """``upload`` for int32 numpy arrays (any shape): packed into one page-locked buffer on the
    host, copied once, returned as device views of the same shapes by the same names."""
    if not host:
        return {}
    offsets: dict[str, int] = {}
    total = 0
    for name, a in host.items():
        offsets[name] = total
        total += -(-a.size // _ALIGN) * _ALIGN
    device = torch.device(device)
    # page-locked for a device, so the copy is asynchronous and the host can go on building the
    # next step while the device still runs this one; torch's caching host allocator does not hand
    # the buffer out again before the copy has completed
    pinned = device.type not in ("cpu", "meta")
    packed = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=pinned)
    flat = packed.numpy()
    for name, a in host.items():
        flat[offsets[name] : offsets[name] + a.size] = a.reshape(-1)
    on_device = packed.to(device, non_blocking=pinned)
    return {
        name: on_device[offsets[name] : offsets[name] + a.size].view(a.shape)
        for name, a in host.items()
    }
