"""Vectorized sampling on any device: no per-row loops and no host syncs (the CPU reference
loops row by row to be obviously right; device backends use this)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def normalized_top_k(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Top-k per row with "off" (0, negative, or >= vocab) spelled as ``vocab``."""
    return torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)


def top_k_top_p_filter(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k first (ties at the k-th value kept), then top-p over the renormalized rest, as
    ``DeviceOps.sample`` specifies; dropped logits become -inf. ``k`` is already normalized."""
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, (k.long() - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # drop a token once the mass ranked before it >= p
    ordered = ordered.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    filter_fn: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
    ] = top_k_top_p_filter,
) -> torch.Tensor:
    """``DeviceOps.sample`` semantics; ``filter_fn(scaled, k, top_p)`` may be a device kernel."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    filtered = filter_fn(scaled, normalized_top_k(top_k, logits.shape[-1]), top_p)
    # an exponential race over the probabilities is a multinomial draw, with no host sync
    probs = filtered.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    picked = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), picked)
