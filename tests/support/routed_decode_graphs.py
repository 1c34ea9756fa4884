"""Decode graphs whose staging route is chosen per step, so CPU tests run both of them."""

from __future__ import annotations

from xhal.executor.decode_graph import DecodeGraphs


class RoutedGraphs(DecodeGraphs):
    """Decode graphs whose steps take the route ``routes`` names in turn: ``host`` (numpy into the
    pinned buffer, one copy) or ``device`` (the multi-tensor copy of a step already on the
    device); both run on CPU tensors here."""

    def __init__(self, routes: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes, self.steps = routes.split("-"), 0

    def _from_host(self, input_ids, positions, m) -> bool:
        self.steps += 1
        return self.routes[(self.steps - 1) % len(self.routes)] == "host"
