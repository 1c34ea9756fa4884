"""A step's small host values up to the device (``to_device``: row indices, per-request
parameters) and its small results (sampled tokens, logprobs) back to the host (``HostCopy``),
neither waiting for the steps queued around it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(
    values: Sequence[Any], device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``values`` (numbers, or rows of them) as a tensor on ``device``, copied without waiting for
    the queued work: a list index or a blocking copy would stall the host until the device
    caught up."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostCopy:
    """Copies of device tensors to host memory, started now and waited for in ``tolist``.

    On an asynchronous device the copies go non-blocking into pinned memory, followed by an event:
    ``tolist`` then waits for exactly the work queued before the copies, not for a next step
    launched meanwhile. On the CPU (or a device without events or pinned memory) the tensors are
    cloned where they are and ``tolist`` reads the clones, synchronizing as a plain read does: a
    clone, since a tensor may be a buffer the next step rewrites (the executor's ``token_ids``).
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        self._event: Any = None
        if all(t.device.type == "cpu" for t in tensors):
            self._tensors = [t.clone() for t in tensors]
            return
        try:
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(hosts, tensors):
                host.copy_(t, non_blocking=True)
            event = torch.Event(device=tensors[0].device)
            event.record()
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            # no pinned memory or events here: read clones on the device in tolist
            self._tensors = [t.clone() for t in tensors]
            return
        self._tensors, self._event = hosts, event

    def tolist(self) -> list[Any]:
        """Every tensor as nested Python lists, once its copy has landed."""
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._tensors]
