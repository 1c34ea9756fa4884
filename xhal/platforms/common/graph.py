"""Stream-graph capture in pieces, shared by the device graph runners (CUDA, NPU).

A key's capture is a list of pieces: device graphs and, between them, the eager functions that
``split`` ran (attention, in piecewise mode) with the static tensor each result is copied into at
replay. Subclasses name their device module (``torch.cuda`` or ``torch.npu``: same graph API) and
may warm up before capturing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from xhal.interfaces.graph import GraphRunner


class PiecewiseStreamGraphRunner(GraphRunner):
    def __init__(self, device_module: Any, graph_class: Any) -> None:
        self._dev, self._graph_class = device_module, graph_class
        self._graphs: dict[Hashable, tuple[list, Any]] = {}
        # key -> (replay, outputs) of a capture that is one graph (a decode step): one call
        self._whole: dict[Hashable, tuple[Callable[[], Any], Any]] = {}
        self._pool = device_module.graph_pool_handle()  # shared by every capture
        self._pieces: list | None = None
        self._open: Any = None

    def warm_up(self, fn: Callable[[], Any]) -> None:
        """Runs on the capture's side stream right before capture; default: nothing."""

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        dev = self._dev
        dev.synchronize()
        side = dev.Stream()
        side.wait_stream(dev.current_stream())
        with torch.no_grad(), dev.stream(side):
            self.warm_up(fn)
            self._pieces = []
            self._begin()
            try:
                outputs = fn()
                self._end()
            finally:
                pieces, self._pieces, self._open = self._pieces, None, None
        dev.current_stream().wait_stream(side)
        self._graphs[key] = (pieces, outputs)
        if len(pieces) == 1 and not isinstance(pieces[0], tuple):
            self._whole[key] = pieces[0].replay, outputs
        return outputs

    def _begin(self) -> None:
        self._open = self._graph_class()
        self._open.capture_begin(pool=self._pool)

    def _end(self) -> None:
        self._open.capture_end()
        self._pieces.append(self._open)

    def split(self, fn: Callable[[], Any]) -> Any:
        if self._pieces is None:
            return fn()
        self._end()
        output = fn()
        self._pieces.append((fn, output))
        self._begin()
        return output

    def replay(self, key: Hashable) -> Any:
        whole = self._whole.get(key)
        if whole is not None:  # the per-step path of a decode graph: host time is what it costs
            whole[0]()
            return whole[1]
        if key not in self._graphs:
            raise KeyError(f"no graph captured for key {key!r}; captured: {list(self._graphs)}")
        pieces, outputs = self._graphs[key]
        for piece in pieces:
            if isinstance(piece, tuple):
                fn, static = piece
                static.copy_(fn())
            else:
                piece.replay()
        return outputs

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def reset(self) -> None:
        for pieces, _ in self._graphs.values():
            for piece in pieces:
                if not isinstance(piece, tuple):
                    piece.reset()
        self._graphs.clear()
        self._whole.clear()
        self._pool = self._dev.graph_pool_handle()
