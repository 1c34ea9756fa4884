"""The engine process: it owns the ``EngineCore`` and runs the step loop, nothing else.

Loop: drain the requests and aborts that arrived, run one step, send that step's outputs (token
ids, one ``StepOutputs`` message per step); answer stats queries between steps. HTTP,
tokenization and detokenization (text deltas, stop strings: ``OutputProcessor``) live in the API
process, so they never stall a step. The process ignores SIGINT (the API process coordinates
shutdown), exits on SIGTERM or a
``Shutdown`` message, and dies with its parent (``PR_SET_PDEATHSIG`` plus a parent-pid check).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from serve_cli.engine.errors import ParamError
from serve_cli.engine.output import RequestOutput, failed_output
from serve_cli.engine.runner.lifetime import die_with_parent
from serve_cli.engine.stats_logger import StatsLogger
from serve_cli.process.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    Shutdown,
    StatsQuery,
    StatsReply,
    StepOutputs,
)

if TYPE_CHECKING:
    from serve_cli.engine.config import EngineConfig

logger = logging.getLogger("xhal.serve.engine")
IDLE_POLL_MS = 100  # how long an idle loop waits for input before re-checking its parent


def run_engine_process(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, log_level: str
) -> None:
    """Entry point of the engine process (a ``multiprocessing`` spawn target)."""
    if not die_with_parent(parent_pid):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    inbox.connect(input_addr)
    outbox.connect(output_addr)
    core = None
    try:
        try:
            from serve_cli.engine.core import EngineCore

            core = EngineCore(config)
        except Exception as e:
            # the API process prints the message as one line; the traceback is for debugging
            logger.debug("the engine failed to start", exc_info=True)
            outbox.send_pyobj(EngineFailed(_one_line(e)))
            return
        outbox.send_pyobj(_ready_message(core))
        EngineLoop(core, inbox, outbox, parent_pid).run()
    except SystemExit:
        pass
    finally:
        if core is not None:
            core.close()  # stops the tensor-parallel workers, if any
        # Only this process ever connects to them, and an orphan's parent cannot clean up.
        for addr in (input_addr, output_addr):
            _remove_ipc_file(addr)
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


class EngineLoop:
    """Drains input, steps the core and ships outputs until shut down or orphaned.

    Invariant: every request the API added gets exactly one finished ``RequestOutput`` (or the API
    aborted it), even when a step raises: then every live request fails with
    ``finish_reason="error"``, the traceback is logged and the loop carries on.
    """

    def __init__(self, core: Any, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.core, self.inbox, self.outbox, self.parent_pid = core, inbox, outbox, parent_pid
        self.live: set[str] = set()
        self.running = True
        interval = getattr(getattr(core, "config", None), "log_stats_interval", 0)
        self.stats_logger = StatsLogger(interval)

    def run(self) -> None:
        while self.running and os.getppid() == self.parent_pid:
            timeout = 0 if self.core.has_unfinished() else IDLE_POLL_MS
            if self.inbox.poll(timeout):
                self._drain()
            if self.running and self.core.has_unfinished():
                self._step()
            self.stats_logger.maybe_log(self.core.stats)

    def _drain(self) -> None:
        rejected: list[RequestOutput] = []
        while True:
            try:
                msg = self.inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(msg, AddRequest):
                try:
                    self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
                    self.live.add(msg.request_id)
                except ValueError as e:  # a ParamError, or a request the KV cache can never hold
                    param = e.param if isinstance(e, ParamError) else None
                    rejected.append(failed_output(msg.request_id, str(e), 400, param))
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    if rid in self.live:
                        self.core.abort(rid)
                        self.live.discard(rid)
            elif isinstance(msg, StatsQuery):
                self.outbox.send_pyobj(StatsReply(msg.query_id, dict(self.core.stats())))
            elif isinstance(msg, Shutdown):
                self.running = False
        if rejected:
            self.outbox.send_pyobj(StepOutputs(rejected))

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception:
            logger.exception("engine step failed; failing its %d live requests", len(self.live))
            reason = traceback.format_exc(limit=1).strip().splitlines()[-1]
            outputs = []
            for rid in sorted(self.live):
                self.core.abort(rid)  # frees its blocks
                outputs.append(failed_output(rid, f"the engine step failed: {reason}"))
        # abort() may itself emit an "abort" output for a request the API already dropped
        outputs = [o for o in outputs if o.request_id in self.live]
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        if outputs:
            self.outbox.send_pyobj(StepOutputs(outputs))


def _ready_message(core: Any) -> EngineReady:
    stats = core.stats()
    return EngineReady(
        pid=os.getpid(),
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        block_size=core.config.block_size,
        num_kv_blocks=stats["kv_blocks_total"],
    )


def _remove_ipc_file(addr: str) -> None:
    if addr.startswith("ipc://"):
        try:
            os.unlink(addr.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
