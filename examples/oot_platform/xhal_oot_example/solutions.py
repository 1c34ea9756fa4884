"""Kernel solutions this package adds to other platforms, through the ``xhal.solutions`` entry
point: here a CPU ``rms_norm`` computed in float64 ("oot-float64"). It ranks below the CPU
reference, so it is chosen only when forced (``XHAL_KERNEL_RMS_NORM=oot-float64``); the
conformance suite runs it either way."""

from __future__ import annotations

import torch

from xhal.solutions import Requirement, Solution


class Float64Norm:
    """A provider: built once per platform, its ``rms_norm`` is the implementation."""

    def __init__(self, platform: object) -> None:
        del platform

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xd = x.double()
        return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(
            x.dtype
        )


SOLUTIONS = (
    Solution(
        "rms_norm",
        "oot-float64",
        "xhal_oot_example.solutions:Float64Norm",
        Requirement(device_type="cpu"),
        priority=-20,
        description="rms_norm in float64, rounded once",
    ),
)
