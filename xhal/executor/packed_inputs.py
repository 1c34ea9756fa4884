"""A graph's persistent int32 inputs as views of one device buffer, filled from page-locked host
buffers: a step written with numpy crosses to the device in one copy.

On a GPU host every tensor operation costs 5-17 us of host time and every host-to-device pair is
its own runtime call, so staging a step field by field costs more than the graph launch. Here the
fields sit back to back (each on a 64-byte boundary) in one device buffer, mirrored by ``slots``
pinned host buffers that take turns: a step writes its values into the next host buffer (through
numpy views, well under a microsecond a field, or as host pairs of ``upload``'s one multi-tensor
copy, which spares a ``.numpy()`` per field) and ``upload`` queues one copy of its first
``count`` values. A host buffer is rewritten only once the copy last queued from it has run
(``upload_fences.py``: an event per ``group`` uploads, since each event call costs as much host
time as the copy): free unless the host runs ``slots - group`` steps ahead of the device, and
never a torn step on the device. The ring is as long as a small pinned budget allows (8 to 32
buffers) and a group is half of it, so at most one step in ``group`` (one in 16 for a decode
graph's typical buffer) makes an event call: a median step makes none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from xhal.executor.upload_fences import UploadFences

_ALIGN = 16  # int32 values: 64 bytes, the alignment a tensor of its own would have
# ((start, count) -> device view, host view) pairs kept per slot; a long-running server's counts
# are bounded by its batch sizes times its table widths, and past this many the cache starts over
_MAX_COUNTS = 4096
# the ring's length: as many buffers as fit in this many pinned bytes, within these bounds
_RING_BYTES = 8 << 20
_MIN_SLOTS, _MAX_SLOTS = 8, 32


def ring_slots(buffer_bytes: int) -> int:
    """How many host buffers the ring of a ``buffer_bytes`` layout has: as many as fit in
    ``_RING_BYTES``, at least 8 and at most 32 (past 32 an event per 16 steps is already off
    the median step)."""
    return max(_MIN_SLOTS, min(_MAX_SLOTS, _RING_BYTES // max(buffer_bytes, 1)))


class PackedInputs:
    """``views[name]`` (device, the shape given) are what a captured graph reads; ``begin`` hands
    out the numpy views of the next host buffer by the same names, ``upload(count)`` copies its
    first ``count`` values (the fields in the order given, so a step copies up to the last field
    it wrote) into the device buffer."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        initial: Mapping[str, int],
        device: torch.device,
        slots: int | None = None,
        group: int | None = None,
    ) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, shape in shapes.items():
            self.offsets[name] = total
            total += -(-int(np.prod(shape)) // _ALIGN) * _ALIGN
        self.size = total
        slots = ring_slots(4 * total) if slots is None else slots
        group = max(1, slots // 2) if group is None else group
        if not 1 <= group <= slots:
            raise ValueError(f"PackedInputs needs 1 <= group <= slots, got {group} and {slots}")
        # page-locked only for a device apart from the host: the copy is then asynchronous and the
        # host goes on; on the CPU the copy is a memcpy, done when ``copy_`` returns
        self._async = device.type not in ("cpu", "meta")
        self._host = [torch.zeros(total, dtype=torch.int32, pin_memory=self._async)
                      for _ in range(slots)]  # fmt: skip
        self._host_views = [self._named(buffer.numpy(), shapes) for buffer in self._host]
        # the same fields as torch views, for the host pairs of ``upload``'s one multi-tensor copy
        self.host_tensors = [self._named(buffer, shapes) for buffer in self._host]
        for views in self._host_views:
            for name, value in initial.items():
                views[name][...] = value
        # every field at its initial value; a buffer of its own even on the CPU (no alias)
        self.buffer = self._host[0].to(device, copy=True)
        self.views = self._named(self.buffer, shapes)
        self._fences = (
            UploadFences(slots, group, lambda: torch.Event(device=self.buffer.device))
            if self._async
            else None
        )
        self._pairs: list[dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in self._host
        ]
        self.slots, self.group = slots, group
        self.slot = 0  # which host buffer ``begin`` handed out last (for a caller's own state)
        self._uploads = 0

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """The ring's host buffers (pinned on a device apart from the host)."""
        return list(self._host)

    def _named(self, flat, shapes: Mapping[str, tuple[int, ...]]) -> dict:
        return {
            name: flat[self.offsets[name] : self.offsets[name] + int(np.prod(shape))].reshape(shape)
            for name, shape in shapes.items()
        }

    def begin(self) -> dict[str, np.ndarray]:
        """The numpy views of the next host buffer, once the copy last queued from it has run.
        Values a step does not write are what this buffer held after its last step."""
        self.slot = slot = self._uploads % self.slots
        if self._fences is not None:
            self._fences.before(self._uploads)
        return self._host_views[slot]

    def upload(
        self,
        count: int,
        fill: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
        then: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
        start: int = 0,
    ) -> None:
        """Queue the copy of values ``[start, count)`` of the buffer ``begin`` handed out (a step
        whose first field is already on the device starts past it).

        ``fill`` (destinations in that buffer, e.g. views of ``host_tensors[slot]``, and host
        sources) is copied in first and ``then`` (pairs on the device) after the upload, all in
        one multi-tensor copy: one call into torch for the whole step, whose pairs run in the
        order given (host pairs are memcpys done before the upload is queued; device pairs
        queue behind it on the same stream)."""
        pairs = self._pairs[self.slot]
        pair = pairs.get((start, count))
        if pair is None:
            if len(pairs) >= _MAX_COUNTS:
                pairs.clear()
            host = self._host[self.slot]
            pair = pairs[start, count] = self.buffer[start:count], host[start:count]
        if fill is None and then is None:
            pair[0].copy_(pair[1], non_blocking=self._async)
        else:
            dst, src = [pair[0]], [pair[1]]
            if fill is not None:
                dst, src = [*fill[0], *dst], [*fill[1], *src]
            if then is not None:
                dst, src = [*dst, *then[0]], [*src, *then[1]]
            torch._foreach_copy_(dst, src, non_blocking=self._async)
        if self._fences is not None:
            self._fences.after(self._uploads)
        self._uploads += 1
