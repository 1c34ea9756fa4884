"""What the scheduler hands the engine for one step: per request, the tokens to feed and where their
KV goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_cli.engine.request import Request

# Stands in for a token sampled by the step in flight: the input builder fills it on the device.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    Invariants:
    - ``1 <= len(token_ids) == len(slot_mapping)``; token ``i`` sits at position
      ``start_position + i``.
    - Position ``p``'s KV slot is ``block_table[p // block_size] * block_size + p % block_size``;
      ``block_table`` covers every position in ``[0, end_position)``, and positions below
      ``start_position`` are already in the cache (computed earlier, or shared by the prefix cache).
    - ``produces_token`` is true exactly when the chunk ends at the last token (known or in
      flight), so the logits of its last position are sampled; an earlier prefill chunk produces
      nothing.
    - With async scheduling, a request whose token the previous step (still in flight) samples
      feeds that token as ``PLACEHOLDER_TOKEN_ID`` (then its whole chunk, one token); the input
      builder takes its value from that step's sampled tokens on the device.
    - ``prompt_targets[i]`` is the prompt token that row ``i`` predicts, for the leading rows
      whose next token is a prompt token, when the request scores its prompt (else empty).
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    produces_token: bool
    block_table: list[int]
    slot_mapping: list[int]
    prompt_targets: list[int] = field(default_factory=list)

    @classmethod
    def for_chunk(cls, request: Request, start: int, end: int, block_size: int) -> ScheduledRequest:
        """Feed ``request``'s tokens at positions ``[start, end)``, whose slots it already holds."""
        blocks, bs = request.block_ids, block_size
        known = request.token_ids[start:end]
        scored = min(end, request.num_prompt_tokens - 1) if request.scores_prompt else start
        return cls(
            request_id=request.request_id,
            token_ids=known + [PLACEHOLDER_TOKEN_ID] * (end - start - len(known)),
            start_position=start,
            produces_token=end == request.num_tokens + request.num_placeholders,
            block_table=list(blocks),
            slot_mapping=[blocks[p // bs] * bs + p % bs for p in range(start, end)],
            prompt_targets=request.token_ids[start + 1 : scored + 1] if scored > start else [],
        )

    @property
    def num_tokens(self) -> int:
        """Tokens fed this step (the query length)."""
        return len(self.token_ids)

    @property
    def num_placeholders(self) -> int:
        """Tokens fed this step whose value the step in flight samples."""
        return sum(1 for t in self.token_ids if t == PLACEHOLDER_TOKEN_ID)

    @property
    def end_position(self) -> int:
        """KV length after this step (the sequence length attention sees)."""
        return self.start_position + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start_position, self.end_position)


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, in the order the engine should lay it out.

    Invariants: request ids are unique; ``num_tokens <= max_num_batched_tokens`` and
    ``num_seqs <= max_num_seqs`` of the scheduler that built it. ``num_running`` / ``num_waiting``
    are the queue sizes after scheduling (for metrics); ``preempted_ids`` lists the requests
    preempted this step.
    """

    requests: list[ScheduledRequest]
    block_size: int
    num_running: int
    num_waiting: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def sampled_request_ids(self) -> list[str]:
        """The requests whose token ``advance`` expects after this step."""
        return [r.request_id for r in self.requests if r.produces_token]
