"""Reference collectives over a gloo group, composed from the plainest torch.distributed calls."""

from __future__ import annotations

import torch
import torch.distributed as dist

from xhal.interfaces.collective import Collective


class GlooCollective(Collective):
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if x.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by "
                f"world_size {self.world_size}"
            )
        return self.all_reduce(x).chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        out = x.clone()
        dist.broadcast(out, src=dist.get_global_rank(self.group, src), group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)
