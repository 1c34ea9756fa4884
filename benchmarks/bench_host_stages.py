"""Per-stage host time of a served decode step on the CPU: the stages the engine process runs
per step, and what the API process then does with the step's message, timed one by one on a real
engine in steady decode.

    python -m benchmarks.bench_host_stages [--model DIR] [--batch 1 32] [--steps 30]

Engine process, in the order a synchronous step runs them: scheduling (``Scheduler.next_batch``),
input build (``InputBuilder.describe``: the batch flattened for the host), upload
(``InputBuilder.upload``: xLLM layout, adapter, host-to-device copy), execute
(``ModelExecutor.execute``; on the CPU this is the model's compute too, not only host work),
logits, sampling (launch + read back), output (``PostProcessor.outputs``: EOS and stop-token
checks, scheduler bookkeeping, token-id outputs) and IPC send (pickling the step's one
``StepOutputs`` message, as ``send_pyobj`` does). API process, off the step loop: IPC receive
(unpickling it) and detokenization (``OutputProcessor.process``: text deltas and stop strings).
Medians over ``--steps`` decode steps, in microseconds.

Before detokenization moved to the API process, the engine ran it inside its step (an
``IncrementalDetokenizer.add_token`` per token, between sampling and output): run this file from
a checkout before that change for those figures (its stage names are the same where they match).

Second table, the served loop: ``EngineCore.step`` with async scheduling, as the engine process
runs it (step N+1 scheduled, built and launched before step N is read back), plus pickling its
message; each stage timed by a probe around the engine's own method, ``loop`` the whole call.
With ``--zero-cost`` (the default on the CPU) the executor's ``execute`` and ``compute_logits``
return preallocated tensors, so the device is out of the picture and ``loop`` is the host's cost
per step: the figure that must fit inside one device step for the device never to wait. On a
device, ``read back`` includes the wait for the step in flight; ``loop - read back`` is then the
host's share.

    python -m benchmarks.bench_host_stages --device cuda --model DIR --load-format dummy
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ENGINE_STAGES = ("schedule", "input build", "upload", "execute", "logits", "sample", "output",
                 "ipc send")  # fmt: skip
API_STAGES = ("ipc receive", "detokenize")
STAGES = ENGINE_STAGES + API_STAGES
# the served loop's stages, each the engine method of that name's calls within one step
LOOP_STAGES = ("schedule", "input build", "upload", "execute", "logits", "sample", "read back",
               "output", "ipc send")  # fmt: skip
LOOP_TOTALS = (*LOOP_STAGES, "loop", "loop - read back")
COUNTS = ("torch ops", "non-view ops", "python calls")


def _engine(model_dir: Path, batch: int, **overrides: Any):
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.core import EngineCore

    settings = dict(
        model_dir=model_dir, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048,
        max_model_len=1024, num_kv_blocks=max(64, batch * 8), enable_prefix_caching=False,
        async_scheduling=False, enforce_eager=True, log_stats_interval=0,
    )
    return EngineCore(EngineConfig(**(settings | overrides)))


def measure(model_dir: Path, batch: int, steps: int, prompt_len: int = 32) -> dict[str, float]:
    """Median microseconds per stage over ``steps`` decode steps of ``batch`` requests."""
    from serve_cli.engine.output_processor import OutputProcessor
    from serve_cli.engine.runner.model_runner import SampledToken
    from serve_cli.engine.sampling import SamplingParams
    from serve_cli.engine.step_pipeline import DeviceStep
    from serve_cli.process.messages import StepOutputs

    engine = _engine(model_dir, batch)
    processor = OutputProcessor(engine.tokenizer)  # the API process's
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(3, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, params)
        processor.add(f"r{i}", prompt, params.stop)
    for _ in range(3):  # prefill, then a few decodes so every request decodes
        for out in engine.step():
            processor.process(out)
    runner, scheduler, states = engine.runner, engine.scheduler, engine._states
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    for _ in range(steps):
        t0 = time.perf_counter()
        batch_ = scheduler.next_batch()
        t1 = time.perf_counter()
        step = runner.input_builder.describe(batch_)
        t2 = time.perf_counter()
        inputs = runner.input_builder.upload(step, None)
        t3 = time.perf_counter()
        hidden = runner.executor.execute(inputs.input_ids, inputs.positions, inputs.metadata)
        t4 = time.perf_counter()
        logits = runner.executor.compute_logits(hidden, inputs.selected_idxes)
        t5 = time.perf_counter()
        rids = inputs.sampled_request_ids
        pending = runner.sampler.launch(
            logits, [states[r].params for r in rids], [None] * len(rids)
        )
        tokens, logprobs = pending.resolve()
        t6 = time.perf_counter()
        done = DeviceStep(
            batch_,
            {s.request_id: states[s.request_id] for s in batch_.requests},
            sampled=[SampledToken(*row) for row in zip(rids, tokens, logprobs)],
        )
        outputs = engine.postprocessor.outputs(done, states)
        t7 = time.perf_counter()
        blob = pickle.dumps(StepOutputs(outputs), pickle.HIGHEST_PROTOCOL)
        t8 = time.perf_counter()
        received = pickle.loads(blob)
        t9 = time.perf_counter()
        for out in received.outputs:
            processor.process(out)
        t10 = time.perf_counter()
        spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t7,
                 t9 - t8, t10 - t9)  # fmt: skip
        for name, span in zip(STAGES, spans):
            times[name].append(span * 1e6)
    engine.close()
    return {name: statistics.median(v) for name, v in times.items()}


# the loop stages whose probes are running now, innermost last: where a counted op belongs
_running: list[str] = []


class _Probe:
    """Wraps one bound method of the engine's own objects, adding each call's wall time to a
    per-step total (the benchmark reads and resets it every step) and counting the calls."""

    def __init__(self, fn: Callable[..., Any], clock: Callable[[], float], name: str) -> None:
        self.fn, self.clock, self.total, self.calls, self.name = fn, clock, 0.0, 0, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        _running.append(self.name)
        t0 = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += self.clock() - t0
            _running.pop()


def _zero_cost(executor: Any, batch: int, vocab_size: int) -> None:
    """Make ``executor``'s two per-step calls free: the device (or the CPU's compute) leaves the
    picture and what the loop still spends is the host's."""
    hidden = torch.zeros(2048, 8)
    logits = torch.zeros(max(batch, 1), vocab_size)
    executor.execute = lambda input_ids, positions, metadata, **_: hidden[: input_ids.shape[0]]
    executor.compute_logits = lambda h, selected=None: logits[
        : h.shape[0] if selected is None else selected.shape[0]
    ]


def _no_op_replays(executor: Any) -> None:
    """Decode graphs whose replay returns the captured outputs without running them: every
    host-side part of a graph step (staging, plan, the calls around the replay) still runs, the
    model's compute does not (the CPU stand-in for a device that replays in no host time)."""
    runner = executor.decode_graphs.graphs
    runner.replay = lambda key: runner._graphs[key].outputs


def measure_loop(
    model_dir: Path, batch: int, steps: int, prompt_len: int, device: str, zero_cost: bool,
    clock: Callable[[], float] = time.perf_counter, graphs: bool = False, **engine_args: Any,
) -> dict[str, Any]:
    """Median microseconds per served-loop step (async scheduling) and per stage within it, on
    ``clock`` (``time.thread_time``: this thread's CPU time, which a busy shared machine's other
    processes disturb less than wall time; it leaves out the time blocked on the device)."""
    from serve_cli.engine.sampling import SamplingParams
    from serve_cli.process.messages import StepOutputs

    engine = _engine(
        model_dir, batch, device=device, async_scheduling=True,
        enforce_eager=device == "cpu" and not graphs,
        num_kv_blocks=max(64, batch * (prompt_len + steps) // 8),
        **engine_args,
    )  # fmt: skip
    runner = engine.runner
    if graphs:
        _no_op_replays(runner.executor)
    elif zero_cost:
        _zero_cost(runner.executor, batch, engine.vocab_size)
    owners = {
        "schedule": (engine.scheduler, "next_batch"),
        "input build": (runner.input_builder, "describe"),
        "upload": (runner.input_builder, "upload"),
        "execute": (runner.executor, "execute"),
        "logits": (runner.executor, "compute_logits"),
        "sample": (runner.sampler, "launch"),
        "read back": (runner, "collect"),
        "output": (engine.postprocessor, "outputs"),
    }
    probes = {}
    for name, (owner, attr) in owners.items():
        probes[name] = _Probe(getattr(owner, attr), clock, name)
        setattr(owner, attr, probes[name])
    # enough tokens for the timed steps and the 40 counted after them
    params = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(3, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):  # prefill, then decodes until every request is in steady decode
        engine.step()
    times: dict[str, list[float]] = {s: [] for s in LOOP_TOTALS}
    for _ in range(steps):
        for probe in probes.values():
            probe.total = 0.0
        t0 = clock()
        outputs = engine.step()
        t1 = clock()
        if len(outputs) != batch or any(o.error for o in outputs):
            raise RuntimeError(f"a measured step did not decode every request: {outputs[:2]}")
        pickle.dumps(StepOutputs(outputs), pickle.HIGHEST_PROTOCOL)
        t2 = clock()
        for name, probe in probes.items():
            times[name].append(probe.total * 1e6)
        times["ipc send"].append((t2 - t1) * 1e6)
        times["loop"].append((t2 - t0) * 1e6)
        times["loop - read back"].append(times["loop"][-1] - times["read back"][-1])
    result = {name: statistics.median(v) for name, v in times.items()}
    result |= _counts(engine, steps=20)
    engine.close()
    return result


def _counts(engine: Any, steps: int) -> dict[str, Any]:
    """Torch ops (each a dispatcher call; every one that is not a view, or that made a new
    tensor where its schema allows a view, is a launch on a GPU) and Python function calls per
    served-loop step: counts, which a busy machine cannot blur. Under ``"launches"``: those
    launching ops of a step by the stage that issued them (a graph replay counts as none: its
    captured work is not dispatched again on a device)."""
    import collections
    import cProfile
    import pstats

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def makes_tensor(args: tuple, kwargs: dict, result: Any) -> bool:
        """Whether an op returned a tensor sharing no storage with its inputs."""
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                   for t in tree_flatten(result)[0])  # fmt: skip

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.all = self.launching = 0
            self.by_stage: collections.Counter[tuple[str, str]] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.all += 1
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            # by storage, not schema: a "may alias" op (to.dtype, reshape) that made a new
            # tensor launched a kernel (in inference mode the LM head's float cast is one)
            if not func.is_view or makes_tensor(args, kwargs, result):
                self.launching += 1
                self.by_stage[_running[-1] if _running else "loop", str(func)] += 1
            return result

    with Ops() as ops:
        for _ in range(steps):
            engine.step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    calls = pstats.Stats(profile).total_calls
    launches = {key: n / steps for key, n in sorted(ops.by_stage.items())}
    return {"torch ops": ops.all / steps, "non-view ops": ops.launching / steps,
            "python calls": calls / steps, "launches": launches}  # fmt: skip


def _table(title: str, names: tuple[str, ...], results: dict[int, dict[str, float]]) -> None:
    print(title)
    print(f"{'stage':<14}" + "".join(f"{'batch ' + str(b):>12}" for b in results))
    for name in names:
        print(f"{name:<14}" + "".join(f"{r[name]:>12.0f}" for r in results.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint dir (default: the built-in model)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--loop-steps", type=int, default=200, help="steps of the loop table")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (loop table)")
    parser.add_argument("--device", default="cpu", help="the engine's device (loop table)")
    parser.add_argument("--load-format", default="auto", help="'dummy': random weights")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--zero-cost", action=argparse.BooleanOptionalAction, default=None,
        help="execute and compute_logits cost nothing (default: on for the CPU only)",
    )  # fmt: skip
    parser.add_argument("--no-stages", action="store_true", help="only the loop table")
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="loop table: the engine's max_num_seqs, e.g. a server's 64 (default: the batch)",
    )  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=1024, help="loop table")
    parser.add_argument(
        "--prefix-caching", action="store_true", help="loop table: prefix caching on, as served"
    )
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="loop table: wall time, or this thread's CPU time (steadier on a busy machine)",
    )  # fmt: skip
    parser.add_argument(
        "--label", default="", help="printed in the table's title (e.g. main, branch)"
    )
    parser.add_argument(
        "--graphs", action="store_true",
        help="loop table on the CPU: the reference platform's decode graphs with no-op replays "
        "instead of the zero-cost executor (execute's staging and the LM head's host part in)",
    )  # fmt: skip
    parser.add_argument(
        "--launches", action="store_true",
        help="loop table: list each step's non-view ops (a GPU launch each) by stage",
    )  # fmt: skip
    args = parser.parse_args()
    if args.graphs:
        if args.device != "cpu":
            parser.error("--graphs is the CPU stand-in for a device's graphs: use it on the CPU")
        os.environ["XHAL_SERVE_CPU_PLATFORM"] = "cpu"  # cpu-fast captures no graphs
    torch.set_num_threads(1)  # shared CI machines: comparable numbers, not peak ones
    model_dir = args.model
    if model_dir is None:
        from serve_cli.default_model import ensure_default_model

        model_dir = ensure_default_model()
    label = f"{args.label or 'this checkout'}, {model_dir.name}"
    if not args.no_stages and args.device == "cpu":
        results = {b: measure(model_dir, b, args.steps) for b in args.batch}
        _table(f"host time per decode step, median us ({label})", STAGES, results)
        host = [s for s in ENGINE_STAGES if s not in ("execute", "logits")]
        print(
            f"{'engine host':<14}"
            + "".join(f"{sum(results[b][s] for s in host):>12.0f}" for b in args.batch)
        )
        print(
            f"{'api process':<14}"
            + "".join(f"{sum(results[b][s] for s in API_STAGES):>12.0f}" for b in args.batch)
        )
        print("(execute and logits include the CPU's compute; engine host leaves them out; the")
        print(" API process's stages run there, off the engine's step loop)")
    zero_cost = args.device == "cpu" if args.zero_cost is None else args.zero_cost
    loops = {
        b: measure_loop(
            model_dir, b, args.loop_steps, args.prompt_len, args.device, zero_cost,
            time.thread_time if args.clock == "cpu" else time.perf_counter,
            graphs=args.graphs,
            load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
            enable_prefix_caching=args.prefix_caching,
            **({} if args.max_num_seqs is None else {"max_num_seqs": max(args.max_num_seqs, b)}),
        )
        for b in args.batch
    }  # fmt: skip
    cost = "zero-cost executor" if zero_cost else "real executor"
    cost = "no-op graph replays" if args.graphs else cost
    _table(
        f"served loop (async scheduling, {args.device}, {cost}), median {args.clock} us per step "
        f"({label})",
        (*LOOP_TOTALS, *COUNTS),
        loops,
    )
    print("(loop: EngineCore.step + the message's pickling; stages are medians on their own, so")
    print(" they need not add up to it; the counts are per step, not us)")
    if args.launches:
        for b, result in loops.items():
            print(f"non-view ops per step by stage, batch {b} (stage: op x count):")
            for (stage, op), n in result["launches"].items():
                print(f"  {stage:<12} {op} x{n:g}")


if __name__ == "__main__":
    main()
