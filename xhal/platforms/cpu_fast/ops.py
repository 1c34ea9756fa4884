"""The reference DeviceOps with the float32 path's no-op casts and empty concatenations left out
and RMSNorm from one reduction: the same math in fewer torch calls (each costs microseconds of
dispatch, paid ~100 times per decode step), so float32 results agree with ``CpuOps``'s to a few
ulps, not bit for bit (RMSNorm's mean of squares is the squared 2-norm over the width, and the
products on the packed copies of a served model's matrices, ``packed.py``, sum in
another order).
The fused ops are the plain sequence of these, as the reference composes them. RMSNorm (with its
residual add) of a decode step's rows and the greedy pick run as one native C call each where the
kernels are built (``kernels/``), the torch calls below otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xhal.platforms.cpu_fast import scratch
from xhal.platforms.cpu_fast.kernels import calls
from xhal.platforms.cpu_fast.packed import PACKED
from xhal.platforms.cpu_ref.ops import CpuOps, _rotate
from xhal.solutions.solved_ops import SolvedOps

_EPS: dict[float, torch.Tensor] = {}


def _eps(eps: float) -> torch.Tensor:
    """``eps`` as a float32 scalar tensor, made once per value (addcmul adds a tensor)."""
    tensor = _EPS.get(eps)
    if tensor is None:
        tensor = _EPS[eps] = torch.tensor(eps, dtype=torch.float32)
    return tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 RMSNorm. mean(x^2) = ||x||^2 / K: one reduction, then the row scale
    1 / sqrt(mean + eps) in two ops on the [T, 1] column (the reference's pow, mean, add and
    rsqrt are four ops over the rows)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    scale = torch.addcmul(_eps(eps), norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
    return (x * scale).mul_(weight)


class FastCpuOps(CpuOps):
    """Requirements: CPU tensors. float32 inputs (with float32 weights and a rotary dim equal to
    the head dim) take the short path; anything else is the reference's own code. ``linear`` on a
    weight ``CpuFastPlatform.prepare_weights`` packed, with two rows or more, runs the native
    GEMM on the packed copy (float32 accumulation in another order: not bit-identical to torch's
    GEMM)."""

    def __init__(self) -> None:
        super().__init__()
        self._scratch = scratch.Scratch()  # a prefill's gated activation, reused layer to layer

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = PACKED.linear(x, weight, bias)
        return F.linear(x, weight, bias) if out is None else out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 or weight.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        native = calls.add_rms_norm(x, None, weight, eps)
        return _rms_norm(x, weight, eps) if native is None else native[0]

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32 or residual.dtype != torch.float32:
            return super().fused_add_rms_norm(x, residual, weight, eps)
        native = calls.add_rms_norm(x, residual, weight, eps)
        if native is not None:
            return native
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    # the fused ops: the DeviceOps defaults' sequence, with the float32 path spelled out in one
    # frame (each Python call and dtype check they stack costs a microsecond, per layer)
    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32 or residual.dtype != torch.float32 or (
            norm_weight.dtype != torch.float32
        ):
            return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
        native = calls.add_rms_norm(x, residual, norm_weight, eps)
        if native is not None:
            return self.linear(native[0], weight, bias), native[1]
        summed = x + residual
        return self.linear(_rms_norm(summed, norm_weight, eps), weight, bias), summed

    def silu_and_mul_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dtype != torch.float32:
            return super().silu_and_mul_linear(x, weight, bias)
        gate, up = x.chunk(2, dim=-1)
        if x.dim() != 2 or not scratch.worth_it(x, gate.shape[-1]):
            return self.linear(F.silu(gate).mul_(up), weight, bias)
        # a prefill's activation into the reused buffer: read by the product below, then dead
        act = torch.ops.aten.silu.out(gate, out=self._scratch.take(*gate.shape))
        return self.linear(act.mul_(up), weight, bias)

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


class FastSolvedOps(SolvedOps):
    """cpu-fast's ops as the platform serves them: the chosen solutions, and the greedy pick as
    one native call where the kernels are built (``argmax`` has no solutions of its own: on every
    other platform it is the ``DeviceOps`` default, torch's argmax, which takes ~4x longer over
    SmolLM2's 49,152 logits on this CPU). Same picks: the lowest index on ties, NaN first."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        picked = calls.argmax_rows(logits)
        return super().argmax(logits) if picked is None else picked
