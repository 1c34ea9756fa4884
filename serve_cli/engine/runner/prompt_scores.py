"""The logprobs of a request's prompt tokens (``SamplingParams.prompt_logprobs``): each prompt
token after the first, scored by the logits of the position before it, as a ``PromptLogprob``
(its logprob, the ``k`` most likely tokens there, its rank). Read back without waiting for the
steps queued after."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from serve_cli.engine.runner.host_copy import HostCopy
from serve_cli.engine.sampling import PromptLogprob, SamplingParams


class PendingScores:
    """One step's prompt scores, on their way to the host: ``scored`` ``(request_id, first,
    count)`` in row order (prompt positions ``first .. first + count - 1``)."""

    def __init__(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        scored: list[tuple[str, int, int]],
        params: Mapping[str, SamplingParams],
    ) -> None:
        self.scored = scored
        self.ks = [params[rid].prompt_logprobs for rid, _, count in scored for _ in range(count)]
        logp = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
        targets = targets.to(logp.device, non_blocking=True).long()
        chosen = logp.gather(1, targets.view(-1, 1)).view(-1)
        ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
        k = min(max(self.ks), logp.shape[-1])
        top_vals, top_ids = logp.topk(k, dim=-1)
        self.copy = HostCopy([targets, chosen, top_vals, top_ids, ranks])

    def resolve(self) -> dict[str, tuple[int, list[PromptLogprob]]]:
        """request id -> (its first scored prompt position, an entry per scored position)."""
        targets, chosen, top_vals, top_ids, ranks = self.copy.tolist()
        out, row = {}, 0
        for rid, first, count in self.scored:
            entries = []
            for r in range(row, row + count):
                k = self.ks[r]
                top = tuple(zip(top_ids[r][:k], top_vals[r][:k]))
                entries.append(PromptLogprob(targets[r], chosen[r], top, ranks[r]))
            out[rid] = (first, entries)
            row += count
        return out
