"""A tensor-parallel worker process: rank ``r > 0`` of the engine's TP group.

It loads its shard, binds as many KV blocks as rank 0 and then mirrors rank 0's steps: each
``HostStep`` from the pipe is uploaded through the same input builder and adapter, run with the
same ``execute`` and ``compute_logits`` (whose collectives pair with rank 0's), and the logits are
dropped: only rank 0 samples. A step that feeds on the tokens of the step before (async
scheduling) first receives them from rank 0's broadcast. On any error it reports ``Failed`` and
exits, which closes its sockets, so a rank blocked in a collective with it errors out instead of
waiting.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from serve_cli.engine.runner.lifetime import die_with_parent
from serve_cli.engine.runner.tp_protocol import (
    BindKV,
    Failed,
    Ready,
    Started,
    StepDone,
    Stop,
    WorkerArgs,
)

logger = logging.getLogger("xhal.serve.tp_worker")


def run_tp_worker(args: WorkerArgs, conn: Connection) -> None:
    """Entry point of worker ``args.rank`` (a ``multiprocessing`` spawn target)."""
    if not die_with_parent(args.parent_pid):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's owner coordinates shutdown
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        _serve(args, conn)
    except EOFError:  # rank 0 is gone: so is the group, whose finalizers could only hang
        sys.stderr.flush()
        os._exit(0)
    except Exception as e:
        logger.exception("tensor-parallel rank %d failed", args.rank)
        try:
            conn.send(Failed(args.rank, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)  # now, not after finalizers that may wait on a broken process group


def _serve(args: WorkerArgs, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from serve_cli.engine.runner.input_builder import InputBuilder, PreviousTokens
    from serve_cli.engine.runner.platform_choice import serving_platform
    from serve_cli.engine.runner.rank import build_executor, forward
    from xhal import platforms
    from xhal.layers import TensorParallel

    platform = platforms.get(serving_platform(args.config.device))
    conn.send(Started(args.rank))
    group = platform.init_process_group(args.rank, args.world_size, args.init_method)
    config = args.config
    executor = build_executor(
        platform,
        args.model,
        config,
        TensorParallel(args.rank, args.world_size),
        platform.collective(group),
        progress=False,
    )
    bind = conn.recv()
    if isinstance(bind, Stop):  # rank 0 failed to start
        return
    if not isinstance(bind, BindKV):
        raise RuntimeError(f"expected BindKV from rank 0, got {type(bind).__name__}")
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=bind.num_blocks))
    builder = InputBuilder(platform.device(), platform.metadata_convention, config.block_size)
    conn.send(Ready(args.rank))
    sampled_before: list[str] = []  # the request ids the step before sampled, in its order
    while not isinstance(step := conn.recv(), Stop):
        previous = None
        if step.placeholder_idxes:  # async scheduling: rank 0 broadcasts the step before's tokens
            tokens = torch.empty(len(sampled_before), dtype=torch.int64, device=platform.device())
            previous = PreviousTokens(sampled_before, executor.collective.broadcast(tokens, 0))
        forward(executor, builder.upload(step, previous))  # logits dropped: rank 0 samples
        sampled_before = step.sampled_request_ids
        conn.send(StepDone())
    dist.destroy_process_group()
