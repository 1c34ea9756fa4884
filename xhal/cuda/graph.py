"""CUDA graphs: one ``torch.cuda.CUDAGraph`` per key, all in one memory pool."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from xhal.interfaces.graph import GraphRunner


class CudaGraphRunner(GraphRunner):
    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        # warm up on a side stream first: lazy initialization (cuBLAS handles, Triton JIT) cannot
        # happen under capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
            outputs = fn()
        self._graphs[key] = (graph, outputs)
        return outputs

    def replay(self, key: Hashable) -> Any:
        if key not in self._graphs:
            raise KeyError(f"no graph captured for key {key!r}; captured: {list(self._graphs)}")
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()
