"""Turning one step's logits into tokens (and logprobs) through the platform's DeviceOps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_cli.engine.runner import logit_filters
from serve_cli.engine.runner import seen_tokens as history_rules
from serve_cli.engine.runner.host_copy import HostCopy, to_device
from serve_cli.engine.runner.seen_tokens import SeenTokens
from serve_cli.engine.sampling import SamplingParams, TokenLogprobs
from xhal import ops

_SEED_MASK = (1 << 63) - 1  # torch generators take seeds that fit a signed 64-bit integer


@dataclass
class PendingSample:
    """One step's sampling, queued on the device: ``tokens`` ``[S]`` stays there (the next
    step's placeholders read it) while its copy to the host, and that of any logprobs, is under
    way; ``resolve`` waits for the copies only."""

    tokens: torch.Tensor
    copy: HostCopy  # tokens, then (when asked for) chosen [R], top values and top ids [R, n]
    logprob_rows: list[int]
    logprob_ks: list[int]

    def resolve(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """A token per row and, for rows that asked for them, logprobs (the step's one sync)."""
        token_ids, *rest = self.copy.tolist()
        out: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprob_rows:
            chosen, top_vals, top_ids = rest
            for r, (i, k) in enumerate(zip(self.logprob_rows, self.logprob_ks)):
                top = tuple(zip(top_ids[r][:k], top_vals[r][:k]))
                out[i] = TokenLogprobs(token_ids[i], chosen[r], top)
        return token_ids, out


class Sampler:
    """Picks one token per sampled row through ``xhal.ops`` (the platform's ``DeviceOps``).

    Rows of requests without a seed share the engine's generator (seeded once, so a whole run is
    reproducible); a request with a seed has its own generator, used only for its rows, so its
    tokens do not depend on what it is batched with. A request with a penalty or a ``min_tokens``
    brings its ``SeenTokens`` (its history, on the device), which the sampled token is added to.
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
        seen: Sequence[SeenTokens | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` float32 ``[S, V]``, one row per request in ``params`` -> a token per row and,
        for rows that asked for them, logprobs. ``seen``: a row's ``SeenTokens`` where its params
        need its history (None: no row does)."""
        return self.launch(logits, params, generators, seen=seen).resolve()

    def launch(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        out: torch.Tensor | None = None,
        seen: Sequence[SeenTokens | None] | None = None,
    ) -> PendingSample:
        """Queue ``sample``'s work on the device and start reading its results back; no sync.
        The tokens go into ``out`` when given (``[S]``, e.g. the executor's ``token_ids``, where
        the next decode step reads them without a copy), else into an int64 tensor of their
        own."""
        raw = logits  # what logprobs are taken of
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        historic = [i for i, p in enumerate(params) if p.needs_history]
        floored = [i for i, p in enumerate(params) if p.min_p > 0 and not p.greedy]
        if historic and (seen is None or any(seen[i] is None for i in historic)):
            raise ValueError("a row with a penalty or min_tokens needs its SeenTokens")
        if biased or historic or floored:
            logits = logits.clone()  # one copy the rules change in place, in vLLM's order
            if biased:
                logit_filters.add_bias(logits, biased, params)
            if historic:
                history_rules.penalize(logits, historic, params, seen)
            if floored:
                logit_filters.apply_min_p(logits, floored, params)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(params):  # no seeded row: no index to upload
            # a copy of its own: the next step's sampling must not overwrite what is read back
            picked = self._sample_rows(logits, params, None)
            tokens = picked.to(torch.long, copy=True) if out is None else out.copy_(picked)
        elif out is None:
            tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        else:
            tokens = out
        if shared and len(shared) < len(params):
            index = to_device(shared, logits.device)
            picked = self._sample_rows(logits[index], [params[i] for i in shared], None)
            tokens[index] = picked.to(torch.long)
        for i, g in enumerate(generators):
            if g is not None:  # one call per seeded request: its generator sees only its rows
                tokens[i : i + 1] = self._sample_rows(logits[i : i + 1], [params[i]], g)
        if historic:
            history_rules.count(tokens, historic, seen)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        extra = self._logprobs(raw, tokens, params, rows) if rows else []
        ks = [params[i].logprobs for i in rows]
        return PendingSample(tokens, HostCopy([tokens, *extra]), rows, ks)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        if all(p.greedy for p in params):
            return ops.argmax(logits)
        device = logits.device
        return ops.sample(
            logits,
            to_device([float(p.temperature) for p in params], device, torch.float32),
            to_device([max(p.top_k, 0) for p in params], device, torch.int32),
            to_device([float(p.top_p) for p in params], device, torch.float32),
            generator if generator is not None else self.generator,
        )

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        params: Sequence[SamplingParams],
        rows: list[int],
    ) -> list[torch.Tensor]:
        """For ``rows``: the chosen token's logprob ``[R]`` and the top ``n`` values and ids
        ``[R, n]`` (most likely first), of the log-softmax of the raw logits, on the device."""
        index = to_device(rows, logits.device)
        logp = torch.log_softmax(logits[index].float(), dim=-1)  # [R, V]
        chosen = logp.gather(1, tokens[index].view(-1, 1).long()).view(-1)
        n = min(max(params[i].logprobs for i in rows), logp.shape[-1])
        top_vals, top_ids = logp.topk(n, dim=-1)
        return [chosen, top_vals, top_ids]

