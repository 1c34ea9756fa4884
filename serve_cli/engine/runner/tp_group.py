"""Rank 0's side of tensor parallelism: the engine process spawns, feeds and stops the workers.

Each worker has a pipe. Per step rank 0 pickles the step's ``HostStep`` once, writes it to every
pipe, runs its own forward (whose collectives pair with the workers') and waits for each worker's
``StepDone``. Model activations never touch the pipes: they only carry the host lists every rank
turns into the identical ``AttentionMetadata``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from serve_cli.engine.runner.tp_protocol import (
    BindKV,
    Failed,
    Ready,
    Started,
    StepDone,
    Stop,
    WorkerArgs,
)
from serve_cli.engine.runner.tp_worker import run_tp_worker

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.runner.input_builder import HostStep
    from serve_cli.engine.served_model import ServedModel
    from xhal.interfaces.platform import Platform

logger = logging.getLogger(__name__)
T = TypeVar("T")

STARTUP_TIMEOUT_S = 600.0  # a worker's spawn, imports, rendezvous and shard loading
STEP_TIMEOUT_S = 60.0  # a worker's StepDone once rank 0 is past the step's last collective
FAILURE_GRACE_S = 2.0  # how long a failed step waits for the workers' own error reports
STOP_TIMEOUT_S = 10.0  # how long ``close`` waits for a worker to exit before terminating it


class TPWorkers:
    """The ``tensor_parallel_size - 1`` worker processes, seen from rank 0.

    ``TPWorkers(...)`` spawns them and joins rank 0 to their process group (``collective`` is
    rank 0's); ``bind_kv_caches`` once rank 0 has allocated; ``run_step`` per step; ``close``
    stops them (idempotent). Workers are daemonic and die with this process.

    Invariant: a step either completes on every rank, or it raises ``RuntimeError`` naming the
    rank that failed, the workers are stopped and every later step raises too: once one rank has
    failed mid-step the ranks' collectives are out of step and cannot be trusted again.
    """

    def __init__(
        self, platform: Platform, model: ServedModel, config: EngineConfig
    ) -> None:
        world_size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        self.error: str | None = None
        self._group_up = False
        try:
            for rank in range(1, world_size):
                ours, theirs = ctx.Pipe()
                args = WorkerArgs(
                    rank,
                    world_size,
                    init_method,
                    model,
                    config,
                    os.getpid(),
                    logging.getLogger().getEffectiveLevel(),
                )
                proc = ctx.Process(
                    target=run_tp_worker,
                    args=(args, theirs),
                    name=f"xhal-tp-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()  # the worker's end: its exit then reads as EOF here
                self.conns.append(ours)
                self.procs.append(proc)
            self._expect(Started, STARTUP_TIMEOUT_S, "start")
            group = platform.init_process_group(0, world_size, init_method)
            self._group_up = True
        except BaseException:
            self.close(timeout=0)
            raise
        self.collective = platform.collective(group)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def bind_kv_caches(self, num_blocks: int) -> None:
        """Have every worker allocate and bind ``num_blocks`` blocks (rank 0's count)."""
        try:
            for conn in self.conns:
                conn.send(BindKV(num_blocks))
            self._expect(Ready, STARTUP_TIMEOUT_S, "load its shard and bind its KV cache")
        except BaseException:
            self.close(timeout=0)
            raise

    def run_step(self, step: HostStep, local: Callable[[], T]) -> T:
        """Send ``step`` to every worker, run rank 0's ``local()`` forward, wait for the workers;
        returns what ``local`` returned."""
        if self.error is not None:
            raise RuntimeError(
                f"the tensor-parallel group is down ({self.error}); restart the engine"
            )
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
            result = local()
        except Exception as e:
            raise self._fail(f"rank 0: {type(e).__name__}: {e}") from e
        try:
            self._expect(StepDone, STEP_TIMEOUT_S, "finish the step")
        except RuntimeError as e:
            raise self._fail(str(e)) from e
        return result

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the workers (``Stop``, then SIGTERM and SIGKILL for those still running after
        ``timeout`` seconds) and leave the process group. Idempotent; never raises."""
        for conn in self.conns:
            try:
                conn.send(Stop())
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout)
            for stop in (proc.terminate, proc.kill):
                if proc.exitcode is None:
                    stop()
                    proc.join(STOP_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        self.error = self.error or "it was closed"
        if self._group_up:
            import torch.distributed as dist

            self._group_up = False
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group: nothing left to release that matters
                logger.debug("destroying the tensor-parallel process group failed", exc_info=True)

    # internals ---------------------------------------------------------------------------------

    def _expect(self, kind: type, timeout: float, what: str) -> None:
        """One ``kind`` message from every worker; ``RuntimeError`` naming the rank otherwise."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} did not {what} within {timeout:g} s"
                )
            try:
                msg = conn.recv()
            except EOFError:
                proc = self.procs[rank - 1]
                proc.join(FAILURE_GRACE_S)  # for its exit code
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it could "
                    f"{what}"
                ) from None
            if isinstance(msg, Failed):
                raise RuntimeError(f"tensor-parallel rank {msg.rank} failed: {msg.error}")
            if not isinstance(msg, kind):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} sent {type(msg).__name__}, "
                    f"expected {kind.__name__}"
                )

    def _fail(self, reason: str) -> RuntimeError:
        """Tear the group down after a failed step; the error names the first rank at fault
        (a worker's own report beats rank 0's "connection closed" that follows from it)."""
        reports: list[str] = []
        deadline = time.monotonic() + FAILURE_GRACE_S
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            try:
                ready = conn.poll(max(0.0, deadline - time.monotonic()))
                if ready and isinstance(msg := conn.recv(), Failed):
                    reports.append(f"rank {msg.rank}: {msg.error}")
            except (EOFError, OSError):  # gone without a word: killed, or crashed in C++
                proc.join(max(0.0, deadline - time.monotonic()))
                reports.append(f"rank {rank} exited with code {proc.exitcode}")
        self.error = "; ".join(reports) or reason
        logger.error("tensor-parallel step failed (%s): stopping the workers", self.error)
        self.close(timeout=0)  # they may be blocked in a collective that never completes
        return RuntimeError(
            f"tensor-parallel step failed: {self.error}; the worker processes are stopped, "
            "restart the engine"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
