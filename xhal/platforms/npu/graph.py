"""NPU graphs: ``torch.npu.NPUGraph`` captures, all in one memory pool (``NPUGraph``,
``graph_pool_handle`` and ``graph`` of the wheel's ``torch_npu/npu/graphs.py``).

A key's capture is a list of pieces: NPU graphs and, between them, the eager functions ``split``
ran (attention, in piecewise mode) with the static tensor each result goes to. Mechanics only:
host arguments a graph bakes (FIA's sequence lengths) are refreshed by the attention backend's
``before_replay`` through the task-group update API, not here.
"""

from __future__ import annotations

import torch

from xhal.platforms.common.graph import PiecewiseStreamGraphRunner


class NpuGraphRunner(PiecewiseStreamGraphRunner):
    """What ``torch.npu.graph(g, pool=...)`` does (``torch_npu/npu/graphs.py``), spelled out so that
    ``split`` can end one graph and begin the next: synchronize, then capture on a side stream. No
    eager warm-up run (unlike the CUDA runner): under a graph-keyed plan the attention backend opens
    FIA task groups, which exist only under capture."""

    def __init__(self) -> None:
        super().__init__(torch.npu, torch.npu.NPUGraph)
