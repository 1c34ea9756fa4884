"""NCCL collectives: the tensor forms NCCL implements natively (xhal.distributed)."""

from __future__ import annotations

from xhal.distributed import TensorCollective


class NcclCollective(TensorCollective):
    """All-reduce, all-gather, reduce-scatter and broadcast on an NCCL group; capturable in CUDA
    graphs as they are."""
