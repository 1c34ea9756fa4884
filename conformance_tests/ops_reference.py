"""Float64 references for the device ops, written from the DeviceOps docstrings alone.

Nothing here imports xhal: the point is to test ``cpu_ref`` too, not to trust it. Each function
takes the (possibly low-precision) inputs the op saw and computes in float64 on the CPU.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _f64(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.detach().to("cpu", F64) for x in xs]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = _f64(x)[0] @ _f64(weight)[0].T
    return out if bias is None else out + _f64(bias)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = _f64(x, weight)
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused sequence: the new residual is stored in x's dtype, and the norm reads it."""
    summed = _f64(x)[0] + _f64(residual)[0]
    return rms_norm(summed.to(x.dtype), weight, eps), summed


def rope_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """float32 ``[max_position, rotary_dim]``: cos in the first half, sin in the second."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
    angles = torch.arange(max_position, dtype=F64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rotary_embedding(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Rotate x ``[T, H, D]``: each channel pair (a, b) is the complex number a + ib multiplied by
    e^{i theta}, a formulation deliberately unlike the chunk / interleave code of a backend."""
    x, cache = _f64(x, cos_sin_cache)
    rotary_dim = cache.shape[-1]
    half = rotary_dim // 2
    cos, sin = cache[positions.cpu().long()].split(half, dim=-1)  # [T, R/2] each
    pair = torch.arange(half)
    # NeoX pairs channel i with i + R/2; GPT-J pairs 2i with 2i + 1
    first, second = (pair, pair + half) if is_neox else (2 * pair, 2 * pair + 1)
    z = torch.complex(x[..., first], x[..., second]) * torch.complex(cos, sin)[:, None, :]
    out = x.clone()
    out[..., first], out[..., second] = z.real, z.imag
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    (x,) = _f64(x)
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return gate / (1.0 + torch.exp(-gate)) * up


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    (x,) = _f64(x)
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
        gelu = 0.5 * gate * (1.0 + torch.tanh(inner))
    else:
        gelu = 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0)))
    return gelu * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Lowest index among the maxima of each row, without relying on ``torch.argmax``'s tie rule."""
    (x,) = _f64(logits)
    index = torch.arange(x.shape[-1]).expand_as(x)
    is_max = x == x.max(dim=-1, keepdim=True).values
    return torch.where(is_max, index, x.shape[-1]).min(dim=-1).values


def sampling_distribution(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """The distribution one row is sampled from, per the ``DeviceOps.sample`` docstring: softmax of
    logits / T, top-k (ties at the k-th value kept), then top-p over the renormalized rest."""
    (row,) = _f64(logits)
    scaled = row / temperature
    if 0 < top_k < row.numel():
        kth = scaled.sort(descending=True).values[top_k - 1]
        scaled = torch.where(scaled >= kth, scaled, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        mass = 0.0
        # walk tokens from most to least likely; a token stays while the mass before it is < p
        for i in probs.sort(descending=True, stable=True).indices.tolist():
            if mass >= top_p or probs[i] == 0:
                break
            keep[i] = True
            mass += float(probs[i])
        probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


ULPS = 1.0  # float32 math rounded once lands on the rounded reference or a neighbour; at 2 ulp
# an RMSNorm without the float32 upcast (measured: exactly 2 ulp off) would pass
ULP_BITS = {torch.bfloat16: 8, torch.float16: 11}  # significand bits, the implicit one included
# below this magnitude an ulp is taken at it: float32 accumulation error on a result that
# cancels to near zero is absolute, not relative
ULP_FLOOR = 2.0**-6


def ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element of float64 ``y``: one unit in the last place of ``y`` rounded to ``dtype``
    (at ``ULP_FLOOR`` for smaller magnitudes); for float32, ``2^-20`` relative plus ``1e-7``."""
    if dtype in ULP_BITS:
        rounded = y.to(dtype).to(F64)
        exponent = torch.floor(torch.log2(rounded.abs().clamp_min(ULP_FLOOR)))
        return torch.exp2(exponent - (ULP_BITS[dtype] - 1))
    return y.abs() * 2.0**-20 + 1e-7


def max_ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest distance of ``out`` from ``ref`` rounded once to ``dtype``, in units in the last
    place of that rounded value (inf for NaN)."""
    out64 = out.detach().to("cpu", F64)
    if out64.shape != ref.shape:
        raise AssertionError(f"output shape {tuple(out64.shape)}, expected {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    rounded = ref.to(dtype).to(F64)
    exponent = torch.floor(torch.log2(rounded.abs().clamp_min(ULP_FLOOR)))
    ulp = torch.exp2(exponent - (ULP_BITS[dtype] - 1))
    return float(((out64 - rounded).abs() / ulp).nan_to_num(float("inf")).max())


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Absolute error on O(1) values, relative on larger ones (the tolerance table's scale)."""
    out64 = out.detach().to("cpu", F64)
    if out64.shape != ref.shape:
        raise AssertionError(f"output shape {tuple(out64.shape)}, expected {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    return float(((out64 - ref).abs() / ref.abs().clamp_min(1.0)).max())
