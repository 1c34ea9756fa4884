"""The step's own token in the split-KV decode launch (``splitkv_decode.py``): its key and value
(``NewToken``), written by the launch at the token's slot and attended as its last position, the
rotary embedding of q and that key (``Rotary``) and, before it, Qwen3's per-head RMSNorm of both
(``QKNorm``), applied in registers first, so a decode layer needs no q/k-norm, rotary or KV-write
launch before its attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class NewToken:
    """The step's key and value, ``[B', Hkv, D]`` (B' >= B, strides free but the last), written
    at ``slot_mapping[i]`` (-1: not written) and attended as position ``kv_len - 1``."""

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class Rotary:
    """Rotate q and the new key first (``DeviceOps.rotary_embedding``: NeoX halves or GPT-J
    pairs, float32 ``cos_sin_cache [max_position, rotary_dim]`` as cos | sin, the dims past
    rotary_dim unrotated) at ``positions[i]`` (int32 / int64 ``[B']``)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool


@dataclass(frozen=True)
class QKNorm:
    """Norm q and the new key first, each head's D channels (``DeviceOps.qk_rms_norm``: q's heads
    with ``q_weight``, k's with ``k_weight``, both ``[D]``), in float32 and rounded to q's and k's
    dtype as the unfused op stores them; then ``Rotary`` (if any) rotates the normed values."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


@triton.jit
def rms_normed(x, x_partner, w, w_partner, eps, HEAD_DIM: tl.constexpr, AXIS: tl.constexpr):
    """Rows of one head (``[ROWS, D]`` over ``AXIS`` 1, or one ``[D]`` row over 0) and their
    rotary partners, normed as ``qk_norm.py`` does: ``x * (1 / sqrt(mean(x^2) + eps)) * w`` in
    float32, rounded to x's dtype (the unfused op's output)."""
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=AXIS) / HEAD_DIM + eps)
    if AXIS == 1:
        inv_rms = inv_rms[:, None]
        w, w_partner = w[None, :], w_partner[None, :]
    normed = (xf * inv_rms * w).to(x.dtype)
    normed_partner = (x_partner.to(tl.float32) * inv_rms * w_partner).to(x.dtype)
    return normed, normed_partner


@triton.jit
def rotation(rot_ptr, d, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per dim of one row: the partner dim, its sign and cos / sin, so that the rotated row is
    ``x * cos + sign * x[partner] * sin`` (dims past rotary_dim: cos 1, sin 0, themselves)."""
    rotated = d < 2 * HALF
    if IS_NEOX:  # halves: (x[i], x[i + HALF])
        low = d < HALF
        partner = tl.where(low, d + HALF, d - HALF)
        freq = tl.where(low, d, d - HALF)
    else:  # GPT-J: interleaved pairs (x[2i], x[2i + 1])
        low = d % 2 == 0
        partner = d ^ 1
        freq = d // 2
    partner = tl.where(rotated, partner, d)
    sign = tl.where(low, -1.0, 1.0)
    cos = tl.load(rot_ptr + freq, mask=rotated, other=1.0)
    sin = tl.load(rot_ptr + HALF + freq, mask=rotated, other=0.0)
    return partner, sign * sin, cos


def norm_args(q: torch.Tensor, new: NewToken | None, norm: QKNorm | None) -> dict:
    """The kernel's q/k-norm arguments by name: both weights None and eps 0 without ``norm``
    (None arguments are constants to Triton, so the plain kernel's parameters stay as they
    were)."""
    if norm is None:
        return {"qw_ptr": None, "kw_ptr": None, "QK_NORM": False, "QK_EPS": 0.0}
    head_dim = q.shape[2]
    if new is None:
        raise ValueError("split-KV decode norms q and k only with the new token (pass new=)")
    weights = (norm.q_weight, norm.k_weight)
    if any(w.shape != (head_dim,) for w in weights) or not norm.eps > 0:
        raise ValueError(
            f"split-KV decode's q/k norm takes two [{head_dim}] weights and eps > 0, got "
            f"{tuple(norm.q_weight.shape)}, {tuple(norm.k_weight.shape)} and eps {norm.eps}"
        )
    qw, kw = (w if w.stride(0) == 1 else w.contiguous() for w in weights)
    return {"qw_ptr": qw, "kw_ptr": kw, "QK_NORM": True, "QK_EPS": float(norm.eps)}


def fused_args(
    q: torch.Tensor, k_cache: torch.Tensor, new: NewToken | None, rotary: Rotary | None
) -> tuple[tuple, tuple, int, bool]:
    """The kernel's new-token arguments (k, v, slots, then four strides) and rotary ones
    (positions, table, row stride), with q's tensors standing in for the unused ones; HALF,
    IS_NEOX."""
    batch, _, head_dim = q.shape
    new_args: tuple = (q, q, q, 0, 0, 0, 0)
    rot_args: tuple = (q, q, 0)
    half, is_neox = 0, True
    if new is not None:
        k, v = new.k, new.v
        hkv = k_cache.shape[2]
        if k.shape[0] < batch or k.shape[1:] != (hkv, head_dim) or v.shape != k.shape:
            raise ValueError(
                f"split-KV decode: new k and v must be [>= {batch}, {hkv}, {head_dim}], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.stride(2) != 1 or v.stride(2) != 1:
            raise ValueError("split-KV decode needs a contiguous last dimension of new k and v")
        if new.slot_mapping.shape[0] < batch:
            raise ValueError(f"split-KV decode: slot_mapping needs >= {batch} entries")
        new_args = (k, v, new.slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    if rotary is not None:
        table = rotary.cos_sin_cache
        if table.dtype != torch.float32 or table.stride(-1) != 1:
            table = table.float().contiguous()
        half = table.shape[-1] // 2
        if 2 * half > head_dim or rotary.positions.dim() != 1:
            raise ValueError(
                f"split-KV decode rotates with a [max_position, <= {head_dim}] table and 1-D "
                f"positions, got {tuple(table.shape)} and {tuple(rotary.positions.shape)}"
            )
        rot_args, is_neox = (rotary.positions, table, table.stride(0)), rotary.is_neox
    return new_args, rot_args, half, is_neox
