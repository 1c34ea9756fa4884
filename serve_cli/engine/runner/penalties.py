"""Presence, frequency and repetition penalties: a request's logits pushed away from the tokens
it has already seen, before it samples (OpenAI's and vLLM's request fields, vLLM's rules).

- ``repetition_penalty`` r (1: off) divides the positive logits, and multiplies the negative
  ones, of every token in the prompt or the output so far;
- ``frequency_penalty`` f subtracts f times a token's count in the output so far;
- ``presence_penalty`` p subtracts p from every token the output holds so far.

A request with a penalty keeps its counts on the device (``Penalties``): the step's sampled
tokens are added there, in stream order, so a step launched before the one ahead of it was read
back (async scheduling) still sees every token generated before it. Logprobs stay those of the
raw logits, as without penalties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_cli.engine.sampling import SamplingParams


class Penalties:
    """One request's seen tokens on the device: ``counts`` (int32 ``[V]``, each token's count in
    the output) and ``in_prompt`` (bool ``[V]``), made at its first sampled step, when the
    vocabulary size (the logits' width) is known."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self.one: torch.Tensor | None = None  # what a sampled token adds to its count

    def ready(self, vocab_size: int, device: torch.device) -> None:
        if self.counts is not None:
            return
        # the ids go up without waiting for the queued work (a blocking copy would stall the host)
        ids = torch.tensor(self.prompt_token_ids, dtype=torch.long).to(device, non_blocking=True)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[ids] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.one = torch.ones(1, dtype=torch.int32, device=device)


def penalized(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    penalties: Sequence[Penalties | None],
) -> torch.Tensor:
    """``logits`` ``[S, V]`` with ``rows`` (those with a penalty) penalized, as a new tensor."""
    vocab, device = logits.shape[-1], logits.device
    for i in rows:
        penalties[i].ready(vocab, device)
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    picked = logits[index].float()  # [R, V]
    counts = torch.stack([penalties[i].counts for i in rows])
    generated = counts > 0
    seen = generated | torch.stack([penalties[i].in_prompt for i in rows])

    def column(name: str) -> torch.Tensor:  # [R, 1]: a field of each row's params
        values = torch.tensor([[float(getattr(params[i], name))] for i in rows])
        return values.to(device, non_blocking=True)

    r = column("repetition_penalty")
    picked = torch.where(seen, torch.where(picked > 0, picked / r, picked * r), picked)
    picked = picked - column("frequency_penalty") * counts - column("presence_penalty") * generated
    out = logits.clone()
    out[index] = picked.to(out.dtype)
    return out


def count(tokens: torch.Tensor, rows: list[int], penalties: Sequence[Penalties | None]) -> None:
    """Add each of ``rows``' sampled token (``tokens`` ``[S]`` on the device) to its counts."""
    for i in rows:
        seen = penalties[i]
        seen.counts.index_add_(0, tokens[i : i + 1].long(), seen.one)
