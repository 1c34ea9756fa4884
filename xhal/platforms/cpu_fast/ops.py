"""The reference DeviceOps with the float32 path's no-op casts and empty concatenations left out:
the same operations in the same order, so float32 results are bit-identical to ``CpuOps``'s (the
fused ops are the plain sequence of these, as the reference computes them), except for GEMMs on
the packed copies of a served model's widest matrices (``packed.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xhal.platforms.cpu_fast.packed import PACKED
from xhal.platforms.cpu_ref.ops import CpuOps, _rotate


class FastCpuOps(CpuOps):
    """Requirements: CPU tensors. float32 inputs (with float32 weights and a rotary dim equal to
    the head dim) take the short path; anything else is the reference's own code. ``linear`` on a
    weight ``CpuFastPlatform.prepare_weights`` packed, with 2-32 rows, runs oneDNN's GEMM on the
    packed copy (float32 accumulation in another order: not bit-identical to torch's GEMM)."""

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = PACKED.linear(x, weight, bias)
        return F.linear(x, weight, bias) if out is None else out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 or weight.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32 or residual.dtype != torch.float32:
            return super().fused_add_rms_norm(x, residual, weight, eps)
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_dim = cos_sin_cache.shape[-1]
        if q.dtype != torch.float32 or k.dtype != torch.float32 or q.shape[-1] != rotary_dim:
            return super().rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [T, I] buffer fewer to allocate and fault in
