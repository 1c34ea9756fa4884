"""Turning one step's logits into tokens (and logprobs) through the platform's DeviceOps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_cli.engine.sampling import SamplingParams, TokenLogprobs
from xhal import ops

_SEED_MASK = (1 << 63) - 1  # torch generators take seeds that fit a signed 64-bit integer


class Sampler:
    """Picks one token per sampled row through ``xhal.ops`` (the platform's ``DeviceOps``).

    Rows of requests without a seed share the engine's generator (seeded once, so a whole run is
    reproducible); a request with a seed has its own generator, used only for its rows, so its
    tokens do not depend on what it is batched with.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = self.new_generator(seed)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed & _SEED_MASK)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` float32 ``[S, V]``, one row per request in ``params`` -> a token per row and,
        for rows that asked for them, logprobs."""
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            tokens[shared] = self._sample_rows(logits[shared], [params[i] for i in shared], None)
        for i, g in enumerate(generators):
            if g is not None:  # one call per seeded request: its generator sees only its rows
                tokens[i : i + 1] = self._sample_rows(logits[i : i + 1], [params[i]], g)
        token_ids = tokens.tolist()  # the step's one device-to-host sync
        return token_ids, self._logprobs(logits, tokens, params, token_ids)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        if all(p.greedy for p in params):
            return ops.argmax(logits)
        device = logits.device
        temperature = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32)
        top_k = torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int32)
        top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32)
        return ops.sample(
            logits,
            temperature.to(device, non_blocking=True),
            top_k.to(device, non_blocking=True),
            top_p.to(device, non_blocking=True),
            generator if generator is not None else self.generator,
        )

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        params: Sequence[SamplingParams],
        token_ids: list[int],
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return out
        logp = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]: of the raw logits
        chosen = logp.gather(1, tokens[rows].view(-1, 1)).view(-1).tolist()
        n = min(max(params[i].logprobs for i in rows), logp.shape[-1])
        top_vals, top_ids = (t.tolist() for t in logp.topk(n, dim=-1))  # [R, n], most likely first
        for r, i in enumerate(rows):
            k = params[i].logprobs
            top = tuple(zip(top_ids[r][:k], top_vals[r][:k]))
            out[i] = TokenLogprobs(token_ids[i], chosen[r], top)
        return out
