"""Collective building blocks shared by the device backends (all on ``torch.distributed``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from xhal.interfaces.collective import Collective


class SingleRankCollective(Collective):
    """The world of one process: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x

    def barrier(self) -> None:
        pass


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, else the default group when one is initialized, else None (a single rank)."""
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_initialized() else None


class TensorCollective(Collective):
    """Collectives in the tensor forms device libraries implement natively (NCCL, HCCL):
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` along dim 0, moved to ``dim``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._rank, self._world = dist.get_rank(group), dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        dim = dim % x.dim()
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((self._world * src.shape[0], *src.shape[1:]))
        dist.all_gather_into_tensor(out, src, group=self.group)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = dim % x.dim()
        if x.shape[dim] % self._world:
            raise ValueError(
                f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by "
                f"world_size {self._world}"
            )
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // self._world, *src.shape[1:]))
        dist.reduce_scatter_tensor(out, src, group=self.group)
        return out.movedim(0, dim).contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        out = x.clone()
        dist.broadcast(out, src=dist.get_global_rank(self.group, src), group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)
