"""One generation request as the scheduler sees it: its tokens, its progress and the KV blocks it
holds."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* values are OpenAI finish reasons."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its KV was dropped; it will be recomputed
    FINISHED_STOPPED = "stop"  # EOS or a stop string (decided by the engine)
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # cancelled, e.g. the client went away
    FINISHED_ERROR = "error"  # the step that ran it failed

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED_")


@dataclass(eq=False)
class Request:
    """A request's token ids, generation progress and KV blocks.

    Invariants:
    - ``token_ids == prompt_token_ids + output_token_ids``; add outputs only with
      ``append_output_token``.
    - ``0 <= num_computed_tokens <= num_tokens + num_placeholders``: the first
      ``num_computed_tokens`` tokens have (or, for the batches in flight, are getting) KV in the
      slots of ``block_ids``, in order.
    - ``num_placeholders`` counts the tokens sampled for it by steps in flight and not read back
      yet (``advance`` turns each into an output token). While it is positive and the request is
      RUNNING, ``num_computed_tokens >= num_tokens``: every known token has been fed.
    - While not RUNNING, ``block_ids == []`` and ``num_computed_tokens == 0``; a preempted request
      keeps its output tokens and recomputes their KV when it runs again.
    - ``sampling_params`` is opaque here: the scheduler never reads it. ``scores_prompt``: the
      logprobs of its prompt tokens are wanted, so every prompt position is computed (no
      prefix-cache hit) and its chunks carry the prompt tokens their rows predict.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: Any = None
    scores_prompt: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) at the last admission
    num_preemptions: int = 0
    num_placeholders: int = 0  # tokens sampled by steps in flight, not known yet
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every known token: prompt plus outputs so far."""
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished, else ``None``."""
        return self.status.value if self.status.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
