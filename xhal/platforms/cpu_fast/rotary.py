"""Rotary embedding as ``cpu-fast`` applies it inside the KV write: the step's cos / sin rows are
gathered once (every layer of a step rotates at the same positions) into full-width tables, so
that rotating q or k is four elementwise ops instead of the reference's split, six products and
a concatenation. Float32 results are bit-identical to ``CpuOps.rotary_embedding``: the same
products and sums, with ``a - b * s`` spelled ``a + b * (-s)`` (exact in IEEE arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RotaryTables:
    """One step's rotation: ``x' = x * cos + partner(x) * sin`` over the first ``rotary_dim``
    channels, where ``partner`` swaps the two channels of each rotated pair (NeoX: i and
    i + R/2, GPT-J: 2i and 2i + 1) and ``sin`` carries the sign of the pair's first channel."""

    positions: torch.Tensor  # the step's positions and table they were built from (identity
    table: torch.Tensor  # checks: layers with another rope table get tables of their own)
    cos: torch.Tensor  # float32 [T, 1, R]
    sin: torch.Tensor  # float32 [T, 1, R], negated on each pair's first channel
    is_neox: bool

    @classmethod
    def build(
        cls, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
    ) -> RotaryTables:
        # cos_sin_cache: [max_position, R], cos then sin
        cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
        if is_neox:  # pairs (i, i + R/2)
            full_cos = torch.cat([cos, cos], dim=-1)
            full_sin = torch.cat([-sin, sin], dim=-1)
        else:  # pairs (2i, 2i + 1): interleave
            full_cos = torch.stack([cos, cos], dim=-1).flatten(-2)
            full_sin = torch.stack([-sin, sin], dim=-1).flatten(-2)
        return cls(positions, cos_sin_cache, full_cos, full_sin, is_neox)

    def matches(self, positions: torch.Tensor, table: torch.Tensor, is_neox: bool) -> bool:
        return positions is self.positions and table is self.table and is_neox == self.is_neox

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, D]`` -> rotated, in x's dtype (computed in float32, rounded once)."""
        rotary_dim = self.cos.shape[-1]
        xf = x.float()
        part = xf if rotary_dim == x.shape[-1] else xf[..., :rotary_dim]
        if self.is_neox:
            partner = part.roll(rotary_dim // 2, dims=-1)  # [x2, x1]
        else:
            partner = part.unflatten(-1, (rotary_dim // 2, 2)).flip(-1).flatten(-2)
        rotated = part * self.cos + partner * self.sin
        if rotary_dim != x.shape[-1]:  # channels past rotary_dim pass through
            rotated = torch.cat([rotated, xf[..., rotary_dim:]], dim=-1)
        return rotated.to(x.dtype)
