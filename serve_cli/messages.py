"""What the API process and the engine process say to each other (pickled over ZMQ).

API -> engine: ``AddRequest``, ``AbortRequests``, ``StatsQuery``, ``Shutdown``.
Engine -> API: ``EngineReady`` or ``EngineFailed`` once at start, then ``StepOutputs`` after
every step and ``StatsReply`` per query. Only plain data crosses: the API process never needs
torch or the engine's own classes to read a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # serve_cli.engine.sampling.SamplingParams, already validated


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class StatsQuery:
    query_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class EngineReady:
    pid: int
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not start; ``message`` says why (its process logged the traceback)."""

    message: str


@dataclass(frozen=True)
class Output:
    """One request's progress in one step (a plain copy of the engine's ``RequestOutput``).

    ``status`` is the HTTP status the API should answer with when ``finish_reason == "error"``:
    400 when the engine rejected the request on arrival (``param`` names the field when the
    engine said which), 500 when a step failed.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    logprobs: Any = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    status: int = 500
    param: str | None = None  # the offending request field, for a rejected request
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    scheduled_at: float | None = None  # time.monotonic() when the engine first scheduled it


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[Output]


@dataclass(frozen=True)
class StatsReply:
    query_id: int
    stats: dict[str, Any]
