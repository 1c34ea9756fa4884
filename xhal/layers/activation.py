"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from xhal import ops


class SiluAndMul(nn.Module):
    """``[..., 2d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
