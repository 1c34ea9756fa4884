"""The engine process's whole step loop on the CPU, against ``EngineCore.step`` inside it.

    python -m benchmarks.bench_engine_loop [--batch 1 8] [--steps 300] [--profile 12]

``bench_host_stages``' loop table times ``EngineCore.step`` and the message's pickling; the
engine process runs more per step around them (``engine_process.EngineLoop``: the input socket's
poll, request intake, the stats line's clock, the send, Python's garbage collector). This runs
that loop itself, in this process, on ZMQ sockets (``inproc``, the same calls as the server's
``ipc``), with a thread playing the API process (it adds the requests, reads every
``StepOutputs`` and sends ``Shutdown`` once all have finished), and reports per step, in this
thread's CPU time: the whole loop, ``EngineCore.step`` within it, the rest, and the garbage
collector's collections and time (timed through ``gc.callbacks``). ``--freeze`` applies the
engine process's ``gc.freeze()`` after start-up, ``--no-freeze`` leaves it out, for an A/B in one
run. The executor costs nothing here (``--zero-cost``, as in ``bench_host_stages``), so every
figure is the host's. ``--profile N`` prints the N functions with the most own time outside
``EngineCore.step``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_host_stages import _engine, _Probe, _zero_cost


class _GcClock:
    """Collections and their CPU time, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t0 = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._t0
            self.collections[info["generation"]] += 1


def _api_side(feeder: Any, reader: Any, batch: int, max_tokens: int, done: threading.Event) -> None:
    """Add ``batch`` requests, read outputs until every one has finished, then shut down."""
    from serve_cli.engine.sampling import SamplingParams
    from serve_cli.process.messages import AddRequest, Shutdown

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, 250, (32,), generator=g).tolist()
        feeder.send_pyobj(AddRequest(f"r{i}", prompt, params))
    finished = 0
    while finished < batch:
        for out in reader.recv_pyobj().outputs:
            finished += out.finished
    feeder.send_pyobj(Shutdown())
    done.set()


def measure(model_dir: Path, batch: int, steps: int, freeze: bool, profile: int) -> dict[str, Any]:
    """Per-step CPU microseconds of the engine loop and of ``EngineCore.step`` in it."""
    import zmq

    from serve_cli.process.engine_process import EngineLoop

    engine = _engine(
        model_dir, batch, device="cpu", async_scheduling=True, enforce_eager=True,
        num_kv_blocks=max(64, batch * (32 + steps) // 8 + batch),
    )  # fmt: skip
    _zero_cost(engine.runner.executor, batch, engine.vocab_size)
    step_probe = _Probe(engine.step, time.thread_time)
    engine.step = step_probe
    ctx = zmq.Context()
    inbox, feeder = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox, reader = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind("inproc://engine-in")
    feeder.connect("inproc://engine-in")
    outbox.bind("inproc://engine-out")
    reader.connect("inproc://engine-out")
    loop = EngineLoop(engine, inbox, outbox, os.getppid())
    done = threading.Event()
    api = threading.Thread(target=_api_side, args=(feeder, reader, batch, steps, done))
    gc.collect()
    if freeze:
        gc.freeze()
    clock = _GcClock()
    gc.callbacks.append(clock)
    profiler = cProfile.Profile() if profile else None
    api.start()
    t0 = time.thread_time()
    if profiler is not None:
        profiler.enable()
    loop.run()
    if profiler is not None:
        profiler.disable()
    total = time.thread_time() - t0
    gc.callbacks.remove(clock)
    api.join()
    if freeze:
        gc.unfreeze()
    for sock in (inbox, feeder, outbox, reader):
        sock.close(linger=0)
    ctx.term()
    engine.close()
    n = step_probe.calls
    result = {
        "loop": total / n * 1e6,
        "EngineCore.step": step_probe.total / n * 1e6,
        "gc": clock.seconds / n * 1e6,
        "collections": clock.collections,
        "steps": n,
    }
    result["outside step"] = result["loop"] - result["EngineCore.step"]
    if profiler is not None:
        result["profile"] = profiler
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the built-in model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=300, help="output tokens per request")
    parser.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=None,
                        help="gc.freeze() after start-up (default: both, side by side)")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model
    if model_dir is None:
        from serve_cli.default_model import ensure_default_model

        model_dir = ensure_default_model()
    modes = [True, False] if args.freeze is None else [args.freeze]
    print(f"engine loop on the CPU (zero-cost executor), CPU us per step ({model_dir.name})")
    print(f"{'batch':>5} {'gc.freeze':>9} {'loop':>8} {'step':>8} {'outside':>8} {'gc':>8}"
          "  collections (gen 0/1/2)")  # fmt: skip
    for batch in args.batch:
        for freeze in modes:
            r = measure(model_dir, batch, args.steps, freeze, args.profile)
            print(f"{batch:>5} {'on' if freeze else 'off':>9} {r['loop']:>8.0f} "
                  f"{r['EngineCore.step']:>8.0f} {r['outside step']:>8.0f} {r['gc']:>8.1f}  "
                  f"{'/'.join(map(str, r['collections']))} over {r['steps']} steps")  # fmt: skip
            if "profile" in r:
                stats = pstats.Stats(r["profile"])
                stats.sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
