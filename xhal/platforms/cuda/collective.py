"""NCCL collectives: the tensor forms NCCL implements natively
(xhal.platforms.common.collective)."""

from __future__ import annotations

from xhal.platforms.common.collective import TensorCollective


class NcclCollective(TensorCollective):
    """All-reduce, all-gather, reduce-scatter and broadcast on an NCCL group; capturable in CUDA
    graphs as they are."""
