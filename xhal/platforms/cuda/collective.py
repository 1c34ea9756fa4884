"""NCCL collectives: the tensor forms NCCL implements natively
(xhal.platforms.common.collective); and, opt-in, small all-reduces as one-shot reads of peer
memory (``OneShotCollective``)."""

from __future__ import annotations

import logging

import torch

from xhal.platforms.common.collective import TensorCollective

logger = logging.getLogger(__name__)


class NcclCollective(TensorCollective):
    """All-reduce, all-gather, reduce-scatter and broadcast on an NCCL group; capturable in CUDA
    graphs as they are."""


class OneShotCollective(NcclCollective):
    """NCCL, except all-reduces of at most ``MAX_BYTES`` on 2 to 8 ranks: torch's symmetric-memory
    one-shot all-reduce. Each rank copies its tensor into a buffer every rank has mapped, then
    reads every peer's copy over NVLink and sums them (peer loads; no multicast, which the
    machines' docs keep off). One kernel and no ring steps: the candidate for a decode step's
    small all-reduces (issue 14 measures it against NCCL, ``benchmarks/bench_tp.py``).
    ``XHAL_CUDA_ONE_SHOT_ALLREDUCE=1`` makes the platform's collectives this.

    A buffer per dtype is made and exchanged (``rendezvous``, a collective of its own) at the
    first eager all-reduce of that dtype; under a capture before that, and for larger tensors,
    other dtypes or a torch without the op, NCCL runs the call. Every rank takes the same branch,
    since the ranks make the same calls."""

    MAX_BYTES = 1 << 20  # batch 64 x hidden 4096 in bf16 is 512 KB
    DTYPES = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, group) -> None:
        super().__init__(group)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self.unavailable = _one_shot_unavailable()
        if self.unavailable is not None:
            logger.warning("cuda: one-shot all-reduce off (%s); NCCL runs it", self.unavailable)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self._buffer(x)
        if buffer is None:
            return super().all_reduce(x)
        staged = buffer[: x.numel()].view_as(x)
        staged.copy_(x)
        out = torch.empty_like(x)
        one_shot_all_reduce(staged, self.group.group_name, out)
        return out

    def _buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        if (
            self.unavailable is not None
            or not 2 <= self.world_size <= 8
            or x.dtype not in self.DTYPES
            or not x.is_contiguous()
            or x.numel() * x.element_size() > self.MAX_BYTES
        ):
            return None
        buffer = self._buffers.get(x.dtype)
        if buffer is None and not torch.cuda.is_current_stream_capturing():
            buffer = symmetric_buffer(self.MAX_BYTES // x.element_size(), x, self.group.group_name)
            self._buffers[x.dtype] = buffer
        return buffer


def _one_shot_unavailable() -> str | None:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory: {e}"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
    return None


def symmetric_buffer(numel: int, like: torch.Tensor, group_name: str) -> torch.Tensor:
    """``numel`` elements of ``like``'s dtype in memory every rank of the group maps."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(numel, dtype=like.dtype, device=like.device)
    symm_mem.rendezvous(buffer, group_name)
    return buffer


def one_shot_all_reduce(staged: torch.Tensor, group_name: str, out: torch.Tensor) -> None:
    """``out`` = the sum over the ranks of ``staged`` (a view of a ``symmetric_buffer``)."""
    torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name, out)
