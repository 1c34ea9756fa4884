"""NPU graphs: ``torch.npu.NPUGraph`` captures, all in one memory pool (npu.md section 2.1).

A key's capture is a list of pieces: NPU graphs and, between them, the eager functions ``split``
ran (attention, in piecewise mode) with the static tensor each result goes to. Mechanics only:
host arguments a graph bakes (FIA's sequence lengths) are refreshed by the attention backend's
``before_replay`` through the task-group update API, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from xhal.interfaces.graph import GraphRunner


class NpuGraphRunner(GraphRunner):
    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[list, Any]] = {}
        self._pool = torch.npu.graph_pool_handle()  # shared by every capture (section 2.1)
        self._pieces: list | None = None
        self._open: Any = None

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        # What torch.npu.graph(g, pool=...) does (section 2.1), spelled out so that split can end
        # one graph and begin the next: synchronize, then capture on a side stream. No eager
        # warm-up run (unlike the CUDA runner): under a graph-keyed plan the attention backend
        # opens FIA task groups, which exist only under capture.
        torch.npu.synchronize()
        side = torch.npu.Stream()
        side.wait_stream(torch.npu.current_stream())
        with torch.no_grad(), torch.npu.stream(side):
            self._pieces = []
            self._begin()
            try:
                outputs = fn()
                self._end()
            finally:
                pieces, self._pieces, self._open = self._pieces, None, None
        torch.npu.current_stream().wait_stream(side)
        self._graphs[key] = (pieces, outputs)
        return outputs

    def _begin(self) -> None:
        self._open = torch.npu.NPUGraph()
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
        self._pool = torch.npu.graph_pool_handle()
