"""Vectorized torch implementations that run on any device: the "torch" and "vendor" solutions
of platforms whose vendor library is reached through torch itself (cuBLAS, the NPU's matmul)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """A provider (see ``Solution``): plain torch, float32 inside, rounded once. No host syncs,
    no per-row loops, so it is graph-safe on any device."""

    def __init__(self, platform: object = None) -> None:
        del platform  # nothing device-specific to hold

    @staticmethod
    def linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(
            x.dtype
        )

    @classmethod
    def fused_add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = (x.float() + residual.float()).to(x.dtype)  # stored in x's dtype, then normed
        return cls.rms_norm(summed, weight, eps), summed

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    @staticmethod
    def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        gate, up = x.float().chunk(2, dim=-1)
        return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)

    @staticmethod
    def sample(logits, temperature, top_k, top_p, generator=None) -> torch.Tensor:
        from xhal.platforms.common import sampling

        return sampling.sample(logits, temperature, top_k, top_p, generator)
