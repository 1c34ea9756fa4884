"""Copying checkpoint tensors into parameters, with shape checks that name what was expected."""

from __future__ import annotations

import torch


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
            f"{tuple(expected)} (does config.json match the checkpoint?)"
        )


@torch.no_grad()
def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy an unsharded tensor (casting to the parameter's dtype and device)."""
    check_shape(loaded_weight, tuple(param.shape), "weight")
    param.data.copy_(loaded_weight)


@torch.no_grad()
def copy_shard(
    param: torch.Tensor,
    loaded_weight: torch.Tensor,
    dim: int,
    src_start: int,
    size: int,
    dst_start: int = 0,
) -> None:
    """``param[dst_start:dst_start+size] = loaded[src_start:src_start+size]`` along ``dim``."""
    param.data.narrow(dim, dst_start, size).copy_(loaded_weight.narrow(dim, src_start, size))
