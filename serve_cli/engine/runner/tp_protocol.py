"""What rank 0 and a tensor-parallel worker say to each other over the worker's pipe.

rank 0 -> worker: ``BindKV`` once, then a ``HostStep`` per step, then ``Stop``.
worker -> rank 0: ``Started`` (before the rendezvous), ``Ready`` (its KV cache is bound), one
``StepDone`` per step, or ``Failed`` once, after which the worker exits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.served_model import ServedModel


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker process needs to become rank ``rank`` of ``world_size``."""

    rank: int
    world_size: int
    init_method: str  # the torch.distributed rendezvous, hosted by rank 0
    model: ServedModel  # the checkpoint and its config.json, as rank 0 read it
    config: EngineConfig
    parent_pid: int
    log_level: int


@dataclass(frozen=True)
class BindKV:
    num_blocks: int  # the count rank 0 allocated: every rank holds the same block ids


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Started:
    rank: int


@dataclass(frozen=True)
class Ready:
    rank: int


@dataclass(frozen=True)
class StepDone:
    pass


@dataclass(frozen=True)
class Failed:
    rank: int
    error: str  # "ExceptionType: message"
