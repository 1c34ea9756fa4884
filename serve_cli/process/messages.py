"""What the API process and the engine process say to each other (pickled over ZMQ).

API -> engine: ``AddRequest``, ``AbortRequests``, ``StatsQuery``, ``Shutdown``.
Engine -> API: ``EngineReady`` or ``EngineFailed`` once at start, then ``StepOutputs`` after
every step and ``StatsReply`` per query. Only plain data crosses: the API process never needs
torch to read a message. A step's outputs are the engine's own ``RequestOutput`` (torch-free,
plain fields): one output type from the engine to the HTTP response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_cli.engine.output import RequestOutput


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
class StepOutputs:
    """Every output of one engine step, in one message (token ids; the API process makes the
    text)."""

    outputs: list[RequestOutput]


@dataclass(frozen=True)
class StatsReply:
    query_id: int
    stats: dict[str, Any]
