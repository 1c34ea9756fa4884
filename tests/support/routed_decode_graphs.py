"""Decode graphs whose staging route is chosen per step, so CPU tests run both of them."""

from __future__ import annotations

from xhal.executor.decode_graph import DecodeGraphs


class RoutedGraphs(DecodeGraphs):
    """Decode graphs whose steps take the route ``routes`` names in turn: ``host`` (numpy into the
    pinned buffer, one copy), ``ids`` (the host route with the token ids copied in after it, as
    ids on the device other than the graphs' own ``token_ids`` are) or ``device`` (the
    multi-tensor copy of a step already on the device); all run on CPU tensors here."""

    def __init__(self, routes: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes, self.steps = routes.split("-"), 0

    def _from_host(self, input_ids, positions, m) -> bool:
        self.steps += 1
        return self._route() in ("host", "ids")

    def _ids_from_host(self, input_ids) -> bool:
        return self._route() == "host"

    def _route(self) -> str:
        """The route of the step being staged."""
        return self.routes[(self.steps - 1) % len(self.routes)]
