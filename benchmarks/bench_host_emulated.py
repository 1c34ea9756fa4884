"""Host side of a graph decode step on the CPU, FlashInfer emulated: what the executor's Python
and the FlashInfer backend's bookkeeping cost, and what a step calls besides the replay, counted
(counts a busy machine cannot blur). No GPU needed; run from a checkout, since the FlashInfer
emulation lives in ``tests/support/flashinfer_emulation``:

    python -m benchmarks.bench_host_emulated [--batches 1 16 64] [--routes host device]
        [--clock wall|cpu] [--small-model] [--baseline DIR] [--repeats N] [--staggered]

The model is one layer of a Llama-3-8B-shaped config with dummy weights (``--small-model``: the
same attention shape with a small MLP and vocabulary, built in a second rather than a minute: the
host side does not depend on them), every sequence has ``--ctx`` cached tokens; steps advance
every sequence by a token, so one step in 16 crosses a page. The replay is stubbed out (its cost
is the device's), so the times are the host's alone. Routes: ``host`` hands the step's tensors as
a host builds them (the pinned route: into a pinned buffer, one copy), ``served`` the same with
the token ids as the last step's sampled tokens on the device (int64, copied in after the pinned
copy: what ``xhal-serve`` hands in steady decode), ``device`` as if already uploaded (the
multi-tensor copy route, taken here on CPU tensors). On the CPU the pinned
buffers' copy fences (``upload_fences.py``, an event record and wait on a GPU) are stood in for
by counting events, so their calls are counted as a GPU step makes them.

Counted per step: tensor ops (each a device call on a GPU: ``cudaMemcpyAsync`` or a launch),
copy pairs, event calls, torch calls from Python (``.numpy()``, ``data_ptr``, ``copy_``, ...: each
crosses into torch's C++, 0.3-17 us on the H200 host) and Python function calls.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_model import CONFIG
from benchmarks.common import table
from benchmarks.host_timing import DeviceCalls, baseline_graphs

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
# the 8B attention shape (32 heads, 8 KV heads, head dim 128), tiny elsewhere
SMALL = {**CONFIG, "intermediate_size": 256, "vocab_size": 1024}
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


class CountingEvent:
    """Stands in for a device event on the CPU (where every copy has run when ``copy_`` returns):
    counts the calls a GPU step would make."""

    calls = 0

    def record(self) -> None:
        CountingEvent.calls += 1

    def synchronize(self) -> None:
        CountingEvent.calls += 1


def _executor(batch: int, ctx: int, steps: int, shape: dict, graphs_class=None):
    sys.path.insert(0, str(REPO))  # tests/ is a package of the checkout, not installed
    try:
        from tests.support.flashinfer_emulation.plugin import EmulatedFlashInferPlatform
    except ImportError as e:
        raise SystemExit(f"run from a checkout of the repository (needs tests/): {e}") from e
    from models.loader import load_model
    from xhal.executor import ExecutorConfig, ModelExecutor
    from xhal.executor.upload_fences import UploadFences

    model_dir = Path(tempfile.mkdtemp())
    config = {**shape, "num_hidden_layers": 1, "model_type": "llama", "dtype": "bfloat16"}
    (model_dir / "config.json").write_text(json.dumps(config))
    model = load_model(model_dir, dtype=torch.bfloat16, progress=False, load_format="dummy")
    platform = EmulatedFlashInferPlatform(use_tensor_cores=True)
    max_len = ctx + steps + 3 * BLOCK
    cfg = ExecutorConfig(
        dtype=torch.bfloat16, block_size=BLOCK, max_num_seqs=batch, max_model_len=max_len,
        decode_graph_sizes=(batch,), piecewise_token_sizes=(),
    )  # fmt: skip
    executor = ModelExecutor(model, platform, cfg)
    if graphs_class is not None:  # an earlier tree's decode graphs on the same executor
        executor.decode_graphs = graphs_class(platform, executor.backends, cfg, executor._forward)
    packed = executor.decode_graphs.packed
    # the fences a GPU would use (a tree whose ring does not say its group used 4)
    packed._fences = UploadFences(packed.slots, getattr(packed, "group", 4), CountingEvent)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=batch * (max_len // BLOCK) + 1))
    return executor


def _steps(batch: int, ctx: int, count: int, staggered: bool = False) -> list[tuple]:
    """``count`` decode steps of ``batch`` sequences, each with ``ctx`` tokens cached before
    (``staggered``: sequence ``r`` with ``r % 16`` more, so their pages fill at different
    steps, as a server's do: some sequence gains a page in most steps of a large batch)."""
    from xhal.interfaces import AttentionMetadata, BatchKind

    pages = (ctx + count) // BLOCK + 3
    table_ = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages) + 1
    offsets = torch.arange(batch, dtype=torch.int32) % BLOCK if staggered else 0
    out = []
    for i in range(count):
        kv = torch.full((batch,), ctx + 1 + i, dtype=torch.int32) + offsets
        ones = torch.ones(batch, dtype=torch.int32)
        pos = kv - 1
        slots = table_.gather(1, (pos // BLOCK).long().view(-1, 1)).view(-1) * BLOCK + pos % BLOCK
        meta = AttentionMetadata.from_host_lengths(BatchKind.DECODE, ones, kv, table_, slots.int())
        out.append((torch.full((batch,), 7, dtype=torch.int32), pos.clone(), meta))
    return out


def _profiled_calls(run) -> tuple[int, int]:
    """(all function calls, calls into torch) that ``run()`` makes, from cProfile."""
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = sum(nc for _, nc, *_ in stats.values())
    into_torch = sum(nc for (_, _, name), (_, nc, *_) in stats.items() if "torch" in name)
    return total, into_torch


def measure(
    batch: int, ctx: int, route: str, steps: int = 64, shape: dict = CONFIG, graphs_class=None,
    clock=time.perf_counter, staggered: bool = False,
) -> dict:  # fmt: skip
    """Five passes of ``steps`` consecutive steps (page crossings at their natural rate): one
    untimed (so the timed steps find every host buffer of the ring as a steady run leaves it),
    the staging and the attention plan timed apart, whole ``execute`` calls timed, then counted
    twice (tensor ops and events; Python and torch calls). ``route``: ``host`` or ``device``;
    ``shape``: the model config (one layer of it is built); ``graphs_class``: another tree's
    ``DecodeGraphs`` (``host_timing.baseline_graphs``)."""
    executor = _executor(batch, ctx, 5 * steps + 1, shape, graphs_class)
    work = _steps(batch, ctx, 5 * steps + 1, staggered)
    executor.execute(*work[0])  # captures the bucket
    graphs, key = executor.decode_graphs, ("decode", batch)
    static = graphs.graphs.replay(key)
    graphs.graphs.replay = lambda k: static  # the host's time alone
    if route == "device":  # CPU tensors taken as device ones: the multi-tensor copy route
        graphs._from_host = lambda *args: False
    elif route == "served":  # the host route with the ids taken as the last step's tokens on
        graphs._ids_from_host = lambda ids: False  # the device (int64), as a server hands them
        work = [(ids.long(), pos, meta) for ids, pos, meta in work]
    backend = executor.backends[0]
    stage, plan, whole, ops, copies, events = [], [], [], [], [], []
    passes = [work[1 + i * steps : 1 + (i + 1) * steps] for i in range(5)]
    for step in passes.pop(0):  # every host buffer of the ring used once (and warm) before timing
        executor.execute(*step)
    for ids, pos, meta in passes[0]:
        t0 = clock()
        padded = graphs._stage(ids, pos, meta, batch)
        t1 = clock()
        backend.plan(padded, graph_key=key)
        stage.append((t1 - t0) * 1e6)
        plan.append((clock() - t1) * 1e6)
    for ids, pos, meta in passes[1]:
        t0 = clock()
        executor.execute(ids, pos, meta)
        whole.append((clock() - t0) * 1e6)
    for ids, pos, meta in passes[2]:
        before = CountingEvent.calls
        with DeviceCalls(getattr(graphs, "host_buffers", ())) as calls:
            executor.execute(ids, pos, meta)
        ops.append(len(calls.ops))
        copies.append(calls.copies)
        events.append(CountingEvent.calls - before)
    python_calls, torch_calls = _profiled_calls(
        lambda: [executor.execute(*step) for step in passes[3]]
    )
    return {
        "batch": batch, "route": route, "stage_us": statistics.median(stage),
        "plan_us": statistics.median(plan), "execute_us": statistics.median(whole),
        "execute_p90_us": sorted(whole)[int(0.9 * steps)],
        "tensor_ops": statistics.mean(ops), "ops_max": max(ops),
        "copy_pairs": statistics.median(copies), "event_calls": statistics.mean(events),
        "torch_calls": torch_calls / steps, "python_calls": python_calls / steps,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--routes", nargs="+", choices=["host", "served", "device"],
                        default=["host"])  # fmt: skip
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each tree, interleaved")
    parser.add_argument("--baseline", type=Path, help="root of an earlier tree to compare with")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this thread's CPU time (steadier on a busy machine)")
    parser.add_argument("--small-model", action="store_true",
                        help="the 8B attention shape with a tiny MLP and vocabulary (fast)")
    parser.add_argument("--staggered", action="store_true",
                        help="sequences' pages fill at different steps, as served (see _steps)")
    parser.add_argument("--label", default="this tree", help="this tree's name in the table")
    args = parser.parse_args()  # fmt: skip
    torch.set_num_threads(1)
    trees = {args.label: None}
    if args.baseline is not None:
        trees["baseline"] = baseline_graphs(args.baseline)
    shape = SMALL if args.small_model else CONFIG
    rows = []
    for b in args.batches:
        for route in args.routes:
            for repeat in range(args.repeats):  # interleaved, so a noisy spell hits both trees
                for name, graphs_class in trees.items():
                    row = measure(b, args.ctx, route, args.steps, shape, graphs_class,
                                  CLOCKS[args.clock], args.staggered)  # fmt: skip
                    rows.append({"tree": name, "repeat": repeat, **row})
                    gc.collect()  # each executor holds a model and caches of its own
    print(
        table(
            rows,
            f"graph decode step, host side (CPU, FlashInfer emulated, replay stubbed; {args.steps} "
            f"steps each, {args.clock} clock, us{', staggered pages' * args.staggered}); per "
            "step: tensor ops (device calls on a GPU), copy pairs (cudaMemcpyAsync calls from "
            "host tensors), event calls, torch and Python calls",
        )
    )


if __name__ == "__main__":
    main()
