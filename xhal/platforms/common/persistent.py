"""The graph-key policy of ``AttentionBackend`` (``xhal/interfaces/attention.py``), checked once
for every backend: a captured bucket reads the executor's persistent metadata tensors in place,
so a plan for a graph key must come with the very tensors the bucket was captured with."""

from __future__ import annotations

from collections.abc import Hashable

import torch

NOT_PERSISTENT = (
    "a graph bucket reads the metadata tensors it was captured with: plan it with the same "
    "(persistent) device tensors, rewritten in place, at every replay"
)


def addresses(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


class PersistentInputs:
    """The addresses a graph bucket captured, and the check every later plan of it passes."""

    def __init__(self, graph_key: Hashable, *tensors: torch.Tensor) -> None:
        self.graph_key = graph_key
        self._captured = addresses(*tensors)

    def check(self, *tensors: torch.Tensor) -> None:
        """``ValueError`` when a plan hands the bucket other tensors than it was captured with."""
        if addresses(*tensors) != self._captured:
            raise ValueError(f"graph key {self.graph_key!r}: {NOT_PERSISTENT}")
