"""Inverse frequencies of each rope scaling type, computed as Hugging Face transformers'
``modeling_rope_utils`` does (same expressions, same float32 order), so cos/sin match exactly."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

# (params, base, rotary_dim, max_position) -> (inv_freq float32 [rotary_dim / 2], attention_factor)
RopeFn = Callable[[Mapping[str, Any], float, int, int], "tuple[torch.Tensor, float]"]


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def default(params: Mapping[str, Any], base: float, dim: int, max_position: int):
    return _base_inv_freq(base, dim), 1.0


def linear(params: Mapping[str, Any], base: float, dim: int, max_position: int):
    return _base_inv_freq(base, dim) / params["factor"], 1.0


def llama3(params: Mapping[str, Any], base: float, dim: int, max_position: int):
    inv_freq = _base_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(params: Mapping[str, Any], base: float, dim: int, max_position: int):
    original_max_position = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original_max_position
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_position / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation, inv_freq_interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def yarn_max_position(params: Mapping[str, Any], max_position: int) -> int:
    """Positions a yarn-scaled cache must cover: the extended context, not only the configured."""
    factor = params.get("factor") or 1.0
    return max(max_position, int(params["original_max_position_embeddings"] * factor))


ROPE_SCALING: dict[str, RopeFn] = {
    "default": default,
    "linear": linear,
    "llama3": llama3,
    "yarn": yarn,
}


def compute_inv_freq(
    params: Mapping[str, Any] | None, base: float, rotary_dim: int, max_position: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2] float32, attention_factor)`` for the scaling ``params``."""
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if rope_type not in ROPE_SCALING:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; supported: {sorted(ROPE_SCALING)}"
        )
    return ROPE_SCALING[rope_type](params or {}, base, rotary_dim, max_position)
