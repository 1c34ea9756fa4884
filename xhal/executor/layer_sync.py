"""The host's layer synchronizer: ``record_event(layer_id)`` once per layer, in layer order.

One mechanism serves both paths. The layers are the model's ``Attention`` layers, found once by
``attention_layers`` (the same walk that gives each layer its KV cache), so a layer's event
means "layer ``layer_id`` has written this step's K/V and attended" whatever the model's module
layout; nothing reads ``model.model.layers``. Eagerly, a forward hook on each of them records its
event as it finishes. A replayed graph runs every layer inside one launch, so after the replay the
events are recorded for every layer at once, still in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from torch import nn


class LayerSynchronizer(Protocol):
    """What a host passes as ``ModelExecutor.execute(..., layer_synchronizer=...)``."""

    def record_event(self, layer_id: int) -> Any: ...


@contextlib.contextmanager
def recording_layers(
    layers: Sequence[nn.Module], synchronizer: LayerSynchronizer
) -> Iterator[None]:
    """While open, each of ``layers`` (``Attention`` layers, by ``layer_id``) records its event
    right after its forward."""
    handles = [
        layer.register_forward_hook(lambda *_, i=layer.layer_id: synchronizer.record_event(i))
        for layer in layers
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def record_every_layer(layers: Sequence[nn.Module], synchronizer: LayerSynchronizer) -> None:
    """After a graph replay: every layer has finished, so record them all, in order."""
    for layer in layers:
        synchronizer.record_event(layer.layer_id)
