"""CUDA DeviceOps: FlashInfer's fused norm / rope / activation kernels when FlashInfer is present,
otherwise vectorized torch; sampling without host syncs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xhal import sampling
from xhal.interfaces.ops import DeviceOps


class TorchCudaOps(DeviceOps):
    """Vectorized torch: no per-row loops, no host syncs (the CPU reference loops; this must not)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        summed = (x.float() + residual.float()).to(x.dtype)
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        rotary_dim = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache.index_select(0, positions.long()).unsqueeze(1).chunk(2, dim=-1)
        out = []
        for x in (q, k):
            xf, rot = x.float(), x[..., :rotary_dim].float()
            if is_neox:
                x1, x2 = rot.chunk(2, dim=-1)
                rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
            else:
                x1, x2 = rot[..., 0::2], rot[..., 1::2]
                rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
            out.append(torch.cat([rotated, xf[..., rotary_dim:]], dim=-1).to(x.dtype))
        return out[0], out[1]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(x.dtype)

    def gelu_and_mul(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(x.dtype)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().argmax(dim=-1)

    def sample(self, logits, temperature, top_k, top_p, generator=None):
        return sampling.sample(logits, temperature, top_k, top_p, generator)


class FlashInferOps(TorchCudaOps):
    """FlashInfer's fused kernels where their semantics match ours exactly (out of place)."""

    def __init__(self) -> None:
        import flashinfer

        self._fi = flashinfer

    def rms_norm(self, x, weight, eps):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().rms_norm(x, weight, eps)
        return self._fi.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().fused_add_rms_norm(x, residual, weight, eps)
        normed, summed = x.reshape(-1, x.shape[-1]).clone(), residual.reshape(-1, x.shape[-1]).clone()
        self._fi.fused_add_rmsnorm(normed, summed, weight, eps)  # in place: summed += x; normed = norm(summed)
        return normed.view(x.shape), summed.view(x.shape)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        if q.dtype not in (torch.float16, torch.bfloat16):
            return super().rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
        head_dim = q.shape[-1]
        q2, k2 = q.reshape(q.shape[0], -1).clone(), k.reshape(k.shape[0], -1).clone()
        self._fi.apply_rope_with_cos_sin_cache_inplace(
            positions.long(), q2, k2, head_dim, cos_sin_cache.float(), is_neox=is_neox
        )
        return q2.view(q.shape), k2.view(k.shape)

    def silu_and_mul(self, x):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().silu_and_mul(x)
        return self._fi.silu_and_mul(x)

    def gelu_and_mul(self, x, approximate="none"):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().gelu_and_mul(x, approximate)
        fn = self._fi.gelu_tanh_and_mul if approximate == "tanh" else self._fi.gelu_and_mul
        return fn(x)
