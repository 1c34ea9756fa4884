"""``logit_bias`` and ``min_p``: the per-request changes to the logits that need no history
(``seen_tokens.py`` has those that do). vLLM's order: the bias first, then the penalties, then
temperature, then ``min_p``, then top-k and top-p. Each changes the rows it is given in place
(the sampler's own copy of the logits)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from serve_cli.engine.runner.host_copy import to_device
from serve_cli.engine.sampling import SamplingParams


def add_bias(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
    """Add each of ``rows``' ``logit_bias`` to ``logits`` ``[S, V]``."""
    row_ids, token_ids, biases = [], [], []
    for i in rows:
        for token, bias in params[i].logit_bias:
            row_ids.append(i)
            token_ids.append(token)
            biases.append(float(bias))
    device = logits.device
    index = (to_device(row_ids, device), to_device(token_ids, device))
    logits.index_put_(index, to_device(biases, device, logits.dtype), accumulate=True)


def apply_min_p(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
    """In each of ``rows`` (sampled, ``min_p`` > 0), set to -inf the tokens whose probability after
    temperature T is under ``min_p`` times the likeliest's:
    p_i / p_max = exp((l_i - l_max) / T) < min_p  <=>  l_i < l_max + T ln(min_p)."""
    index = to_device(rows, logits.device)
    floor = [[params[i].temperature * math.log(params[i].min_p)] for i in rows]  # [R, 1]
    picked = logits[index]
    limit = picked.max(dim=-1, keepdim=True).values + to_device(floor, logits.device, logits.dtype)
    logits[index] = picked.masked_fill(picked < limit, float("-inf"))
