"""The engine: a torch-free core (requests, the paged KV block manager, the scheduler, sampling
parameters, detokenization) and ``runner/``, its device side (input builder, sampler, model runner).

Nothing in this package outside ``runner/`` imports torch; the scheduler's protocol is ``submit`` ->
``next_batch`` ->
``advance``, so it can be tested (and reasoned about) without a device.
"""

from __future__ import annotations

from serve_cli.engine.batch import ScheduledBatch, ScheduledRequest
from serve_cli.engine.block_manager import BlockManager
from serve_cli.engine.request import Request, RequestStatus
from serve_cli.engine.scheduler import Scheduler

__all__ = [
    "BlockManager",
    "Request",
    "RequestStatus",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
]
