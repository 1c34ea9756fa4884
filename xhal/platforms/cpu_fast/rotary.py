"""Rotary embedding as ``cpu-fast`` applies it inside the KV write: the step's cos / sin rows are
gathered once (every layer of a step rotates at the same positions) into full-width tables, so
that rotating q or k is four elementwise ops instead of the reference's split, six products and
a concatenation; for a step of few tokens (decodes), into one ``D x D`` rotation matrix per
token, so that rotating q and k together is one batched matrix product per layer.

Float32 results agree with ``CpuOps.rotary_embedding`` to an ulp: the elementwise path does the
same products and sums (``a - b * s`` spelled ``a + b * (-s)``, exact in IEEE arithmetic), the
matrix path the same two products per channel, summed by the GEMM (which may fuse a multiply
into the add: one rounding fewer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MATRIX_TOKENS = 32  # steps of at most this many tokens rotate by matrix (16 KB per token)


@dataclass(frozen=True)
class RotaryTables:
    """One step's rotation: ``x' = x * cos + partner(x) * sin`` over the first ``rotary_dim``
    channels, where ``partner`` swaps the two channels of each rotated pair (NeoX: i and
    i + R/2, GPT-J: 2i and 2i + 1) and ``sin`` carries the sign of the pair's first channel.
    ``matrix`` (steps of few tokens) is the same map as ``x' = x @ matrix[t]`` on the whole head,
    the identity on channels past ``rotary_dim``."""

    positions: torch.Tensor  # the step's positions and table they were built from (identity
    table: torch.Tensor  # checks: layers with another rope table get tables of their own)
    cos: torch.Tensor  # float32 [T, 1, R]
    sin: torch.Tensor  # float32 [T, 1, R], negated on each pair's first channel
    is_neox: bool
    matrix: torch.Tensor | None  # float32 [T, D, D], or None (more than MATRIX_TOKENS tokens)

    @classmethod
    def build(
        cls, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool, head_dim: int
    ) -> RotaryTables:
        # cos_sin_cache: [max_position, R], cos then sin
        cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
        if is_neox:  # pairs (i, i + R/2)
            full_cos = torch.cat([cos, cos], dim=-1)
            full_sin = torch.cat([-sin, sin], dim=-1)
        else:  # pairs (2i, 2i + 1): interleave
            full_cos = torch.stack([cos, cos], dim=-1).flatten(-2)
            full_sin = torch.stack([-sin, sin], dim=-1).flatten(-2)
        matrix = None
        if positions.shape[-1] <= MATRIX_TOKENS:
            matrix = _matrix(full_cos[:, 0], full_sin[:, 0], is_neox, head_dim)
        return cls(positions, cos_sin_cache, full_cos, full_sin, is_neox, matrix)

    def matches(self, positions: torch.Tensor, table: torch.Tensor, is_neox: bool) -> bool:
        return positions is self.positions and table is self.table and is_neox == self.is_neox

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, D]`` -> rotated, in x's dtype (computed in float32, rounded once)."""
        if self.matrix is not None and x.dtype == torch.float32:
            return torch.bmm(x, self.matrix)  # [T, heads, D] @ [T, D, D]
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


def _matrix(cos: torch.Tensor, sin: torch.Tensor, is_neox: bool, head_dim: int) -> torch.Tensor:
    """``[T, D, D]`` with ``(x @ m)[j] = x[j] * cos[j] + x[partner(j)] * sin[j]`` for the
    rotated channels ``j < R`` and ``x[j]`` past them; cos, sin ``[T, R]``."""
    num_tokens, rotary_dim = cos.shape
    channels = torch.arange(rotary_dim)
    if is_neox:
        partner = (channels + rotary_dim // 2) % rotary_dim
    else:
        partner = channels ^ 1  # 2i <-> 2i + 1
    matrix = torch.zeros(num_tokens, head_dim, head_dim)
    matrix[:, channels, channels] = cos
    matrix[:, partner, channels] = sin  # row partner(j) of column j: x[partner(j)] * sin[j]
    if rotary_dim < head_dim:
        rest = torch.arange(rotary_dim, head_dim)
        matrix[:, rest, rest] = 1.0
    return matrix
