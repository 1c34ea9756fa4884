"""The sampling rules that depend on what a request has seen so far, with its counts on the
device (``SeenTokens``): the step's sampled tokens are added there in stream order, so a step
launched before the one ahead of it was read back (async scheduling) still sees every token
generated before it, without a sync. vLLM's rules:

- ``repetition_penalty`` r (1: off) divides the positive logits, and multiplies the negative
  ones, of every token in the prompt or the output so far;
- ``frequency_penalty`` f subtracts f times a token's count in the output so far;
- ``presence_penalty`` p subtracts p from every token the output holds so far;
- ``min_tokens`` n: until the output holds n tokens, EOS (unless ``ignore_eos``) and the
  ``stop_token_ids`` cannot be sampled.

Logprobs stay those of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_cli.engine.runner.host_copy import to_device
from serve_cli.engine.sampling import SamplingParams


class SeenTokens:
    """One request's history on the device: ``counts`` (int32 ``[V]``, each token's count in the
    output) and ``in_prompt`` (bool ``[V]``), made at its first sampled step, when the vocabulary
    size (the logits' width) is known; ``blocked_token_ids``, what ``min_tokens`` holds back."""

    def __init__(
        self, prompt_token_ids: Sequence[int], blocked_token_ids: Sequence[int] = ()
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.blocked_token_ids = sorted(blocked_token_ids)
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self.blocked: torch.Tensor | None = None  # bool [V]
        self.one: torch.Tensor | None = None  # what a sampled token adds to its count

    def ready(self, vocab_size: int, device: torch.device) -> None:
        if self.counts is not None:
            return
        self.in_prompt = self._mask(self.prompt_token_ids, vocab_size, device)
        self.blocked = self._mask(self.blocked_token_ids, vocab_size, device)
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.one = torch.ones(1, dtype=torch.int32, device=device)

    @staticmethod
    def _mask(ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[to_device(ids, device)] = True
        return mask


def penalize(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    seen: Sequence[SeenTokens | None],
) -> None:
    """Change ``rows`` of ``logits`` ``[S, V]`` (those with a penalty or a ``min_tokens``) in place
    by the rules above."""
    vocab, device = logits.shape[-1], logits.device
    for i in rows:
        seen[i].ready(vocab, device)
    index = to_device(rows, device)
    picked = logits[index].float()  # [R, V]
    counts = torch.stack([seen[i].counts for i in rows])
    generated = counts > 0
    in_sight = generated | torch.stack([seen[i].in_prompt for i in rows])

    def column(values: list[float]) -> torch.Tensor:  # [R, 1]: one value a row
        return to_device([[v] for v in values], device, torch.float32)

    r = column([params[i].repetition_penalty for i in rows])
    picked = torch.where(in_sight, torch.where(picked > 0, picked / r, picked * r), picked)
    picked = picked - column([params[i].frequency_penalty for i in rows]) * counts
    picked = picked - column([params[i].presence_penalty for i in rows]) * generated
    early = counts.sum(dim=-1, keepdim=True) < column([params[i].min_tokens for i in rows])
    blocked = early & torch.stack([seen[i].blocked for i in rows])
    picked = picked.masked_fill(blocked, float("-inf"))
    logits[index] = picked.to(logits.dtype)


def count(tokens: torch.Tensor, rows: list[int], seen: Sequence[SeenTokens | None]) -> None:
    """Add each of ``rows``' sampled token (``tokens`` ``[S]`` on the device) to its counts."""
    for i in rows:
        history = seen[i]
        history.counts.index_add_(0, tokens[i : i + 1].long(), history.one)
