"""Collective communication over one tensor-parallel group."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Collective(ABC):
    """Collectives over one group, on ``torch.distributed``.

    Invariants: every rank of the group calls the same collectives in the same order with
    tensors of the same shape; results are returned (callers never rely on in-place effects);
    with ``world_size == 1`` every collective returns its input unchanged. ``rank``,
    ``world_size`` and ``broadcast``'s ``src`` are ranks within the group, which need not be the
    whole world (``torch.distributed.get_global_rank`` maps them). Where the platform declares
    graphs, collectives are capturable: a replay reduces what the inputs hold at replay time.
    """

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""

    @abstractmethod
    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's chunk of ``dim`` (size divisible by world)."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank receives ``x`` of group rank ``src`` (a rank within the group)."""

    @abstractmethod
    def barrier(self) -> None: ...
