"""The fast CPU platform: the reference platform with the fast CPU solutions forced, declared
eager."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import torch

from xhal.platforms.cpu_fast.solutions import FAST_OPS
from xhal.platforms.cpu_ref.platform import CpuPlatform
from xhal.solutions.op_names import ATTENTION_OPS

if TYPE_CHECKING:
    from torch import nn


class CpuFastPlatform(CpuPlatform):
    """``cpu-fast``: what the CPU serves with. Collectives and memory queries are the
    reference's, the norms and rotary the reference's math in fewer torch calls (solution
    ``fast``: float32 RMSNorm from one reduction, equal to the reference's to rounding); attention
    is planned once per step and batched (solution ``sdpa``: decodes by batched matrix calls).
    No graphs: on the CPU a recorded "graph" replays the same kernels with more Python around
    them. Its ops serve "cpu" tensors only when it is the first CPU platform created in the
    process (``xhal.ops.register_platform``), as in ``xhal-serve``."""

    name = "cpu-fast"
    capabilities = replace(
        CpuPlatform.capabilities,
        graphs=False,
        notes=("the reference platform with a batched SDPA attention over the paged cache; eager",),
    )
    solution_defaults: ClassVar[dict[str, str]] = {
        **{op: "fast" for op in FAST_OPS},
        **{op: "sdpa" for op in ATTENTION_OPS},
    }

    def __init__(self) -> None:
        from xhal.platforms.cpu_fast.ops import FastSolvedOps

        super().__init__()
        chosen = self.kernels.ops  # the solutions' ops, with cpu-fast's greedy pick on top
        self._ops = FastSolvedOps(chosen.impls, chosen.names)

    def prepare_weights(self, model: nn.Module) -> None:
        """Every float32 matrix is stored transposed (column-major, same shape and values): MKL's
        GEMV and small-batch GEMM stream ``x @ W.T`` faster when W.T is the contiguous one (about
        1.2x over a decode step's projections and LM head here, ``benchmarks/bench_cpu_vs_hf``);
        the embedding lookup that shares the LM head's matrix reads strided rows, a few
        microseconds per token. All but the smallest also get a copy packed for the native
        GEMM, which serves every product of two rows or more: decode batches and a prefill's rows
        (``packed.py``)."""
        from xhal.platforms.cpu_fast import packed

        for param in model.parameters():  # shared (tied) parameters come once
            if param.dim() == 2 and param.dtype == torch.float32 and param.is_contiguous():
                param.data = param.data.t().contiguous().t()
                packed.PACKED.add(param)  # a copy for small batches, when the kernels built
