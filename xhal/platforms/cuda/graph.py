"""CUDA graphs: ``torch.cuda.CUDAGraph`` captures in one memory pool, piecewise when the captured
function calls ``split`` (xhal.platforms.common.graph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xhal.platforms.common.graph import PiecewiseStreamGraphRunner


class CudaGraphRunner(PiecewiseStreamGraphRunner):
    def __init__(self) -> None:
        super().__init__(torch.cuda, torch.cuda.CUDAGraph)

    def warm_up(self, fn: Callable[[], Any]) -> None:
        # lazy initialization (cuBLAS handles, Triton JIT) cannot happen under capture
        fn()
        torch.cuda.synchronize()
