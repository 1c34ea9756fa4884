"""``logit_bias`` and ``min_p``: the per-request changes to the logits that need no history
(``seen_tokens.py`` has those that do). vLLM's order: the bias first, then the penalties, then
temperature, then ``min_p``, then top-k and top-p."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from serve_cli.engine.sampling import SamplingParams


def biased(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` ``[S, V]`` with each of ``rows``' ``logit_bias`` added, as a new tensor."""
    row_ids, token_ids, biases = [], [], []
    for i in rows:
        for token, bias in params[i].logit_bias:
            row_ids.append(i)
            token_ids.append(token)
            biases.append(float(bias))
    device = logits.device
    index = (
        torch.tensor(row_ids, dtype=torch.long).to(device, non_blocking=True),
        torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True),
    )
    values = torch.tensor(biases, dtype=logits.dtype).to(device, non_blocking=True)
    return logits.index_put(index, values, accumulate=True)


def min_p_masked(
    logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]
) -> torch.Tensor:
    """``logits`` with, in each of ``rows`` (sampled, ``min_p`` > 0), the tokens whose probability
    after temperature T is under ``min_p`` times the likeliest's set to -inf, as a new tensor:
    p_i / p_max = exp((l_i - l_max) / T) < min_p  <=>  l_i < l_max + T ln(min_p)."""
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    floor = [params[i].temperature * math.log(params[i].min_p) for i in rows]
    floor_t = torch.tensor(floor, dtype=logits.dtype).to(device, non_blocking=True)
    picked = logits[index]
    limit = picked.max(dim=-1, keepdim=True).values + floor_t[:, None]
    out = logits.clone()
    out[index] = picked.masked_fill(picked < limit, float("-inf"))
    return out
