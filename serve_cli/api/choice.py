"""What one engine request of an HTTP request has produced so far, as the API process sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Choice:
    """What one engine request has produced so far."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None  # the engine's, with the first output, when asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    arrival: float = 0.0  # time.monotonic() values: the HTTP request parsed,
    started: float = 0.0  # sent to the engine,
    scheduled_at: float | None = None  # first scheduled there (the engine's clock, the same one),
    first_token: float | None = None  # its first token back here,
    last_token: float | None = None  # its latest token back here
