"""Tensor-parallel placement, passed explicitly to every sharded layer (no global state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group: ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"TensorParallel needs 0 <= rank < size, got rank={self.rank} size={self.size}"
            )

    def divide(self, total: int, what: str) -> int:
        """``total / size``, raising a clear error when ``total`` does not split evenly."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is not divisible by the tensor-parallel size {self.size}"
            )
        return total // self.size
