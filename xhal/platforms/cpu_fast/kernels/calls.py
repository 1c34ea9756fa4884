"""Tensor-level calls into the native kernels. Each returns None when it does not serve the
call (no kernels built, or inputs that are not float32 rows laid out as the kernel reads them),
and the caller then runs its torch path."""

from __future__ import annotations

import torch

from xhal.platforms.cpu_fast.kernels.native import library

_F32 = torch.float32


def _rows(x: torch.Tensor) -> bool:
    """A 2-D float32 CPU tensor of contiguous rows."""
    return x.dtype == _F32 and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu"


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rms_norm(x + residual), x + residual)`` (``residual`` None: ``(rms_norm(x), x)``) for
    float32 rows ``[T, K]`` and a float32 weight ``[K]``."""
    lib = library()
    if (
        lib is None
        or not _rows(x)
        or weight.dtype != _F32
        or not weight.is_contiguous()
        or weight.shape != x.shape[1:]
        or (residual is not None and (not _rows(residual) or residual.shape != x.shape))
    ):
        return None
    normed = torch.empty_like(x)
    if residual is None:
        summed = x
        lib.xhal_add_rms_norm(
            x.data_ptr(), None, weight.data_ptr(), eps, x.shape[0], x.shape[1],
            normed.data_ptr(), None,
        )  # fmt: skip
    else:
        summed = torch.empty_like(x)
        lib.xhal_add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1],
            normed.data_ptr(), summed.data_ptr(),
        )  # fmt: skip
    return normed, summed


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of float32 rows ``[T, 2 I]`` laid out gate | up -> ``[T, I]``."""
    lib = library()
    if lib is None or x.dtype != _F32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 2:
        return None
    num_tokens, width = x.shape
    out = torch.empty(num_tokens, width // 2, dtype=_F32)
    lib.xhal_silu_mul(x.data_ptr(), num_tokens, width // 2, x.stride(0), out.data_ptr())
    return out
