"""CUDA graphs: one ``torch.cuda.CUDAGraph`` per key, all in one memory pool."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from xhal.interfaces.graph import GraphRunner


class CudaGraphRunner(GraphRunner):
    """A key's capture is a list of pieces: CUDA graphs, and between them the eager functions that
    ``split`` ran (attention, in piecewise mode), each with the static tensor its result goes to."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[list, Any]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._pieces: list | None = None
        self._open: torch.cuda.CUDAGraph | None = None

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        # warm up on a side stream first: lazy initialization (cuBLAS handles, Triton JIT) cannot
        # happen under capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            fn()
            torch.cuda.synchronize()
            self._pieces = []
            self._begin()
            try:
                outputs = fn()
                self._end()
            finally:
                pieces, self._pieces, self._open = self._pieces, None, None
        torch.cuda.current_stream().wait_stream(side)
        self._graphs[key] = (pieces, outputs)
        return outputs

    def _begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
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
            if isinstance(piece, torch.cuda.CUDAGraph):
                piece.replay()
            else:
                fn, static = piece
                static.copy_(fn())
        return outputs

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()
