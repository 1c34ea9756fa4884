"""A solution declared for at most ``max_rows`` rows, and what serves larger calls."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rows(x: torch.Tensor) -> int:
    """Rows of an op's first argument: every leading dimension of a matrix-like input ([T, H],
    [B, S, H]), the length of a vector (positions [T])."""
    return x.numel() // x.shape[-1] if x.dim() > 1 and x.shape[-1] else x.shape[0]


class RowLimited:
    """``small`` for calls of up to ``max_rows`` rows, ``large`` beyond: one shape check per
    call, the kind of fallback a GEMV for decode batches needs (cuBLAS past its rows)."""

    def __init__(self, small: Callable, large: Callable, max_rows: int) -> None:
        self.small, self.large, self.max_rows = small, large, max_rows

    def __call__(self, x, *args):
        return (self.small if rows(x) <= self.max_rows else self.large)(x, *args)
