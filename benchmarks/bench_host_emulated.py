"""Host side of a graph decode step on the CPU, FlashInfer emulated: what the executor's Python
and the FlashInfer backend's bookkeeping cost, and how many tensor operations (device calls, on
a GPU) a step queues besides the replay. No GPU needed; run from a checkout, since the FlashInfer
emulation lives in ``tests/support/flashinfer_emulation``:

    python -m benchmarks.bench_host_emulated [--batches 1 16 64] [--baseline DIR] [--repeats N]

The model is one layer of a Llama-3-8B-shaped config with dummy weights, every sequence has
``--ctx`` cached tokens; steps advance every sequence by a token, so one step in 16 crosses a
page. The replay is stubbed out (its cost is the device's), so the times are the host's alone.
On a GPU each counted operation adds its launch cost (5-17 us on the H200 host:
``bench_host.py``); these numbers are what remains.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def _executor(batch: int, ctx: int, shape: dict, graphs_class=None):
    sys.path.insert(0, str(REPO))  # tests/ is a package of the checkout, not installed
    try:
        from tests.support.flashinfer_emulation.plugin import EmulatedFlashInferPlatform
    except ImportError as e:
        raise SystemExit(f"run from a checkout of the repository (needs tests/): {e}") from e
    from models.loader import load_model
    from xhal.executor import ExecutorConfig, ModelExecutor

    model_dir = Path(tempfile.mkdtemp())
    config = {**shape, "num_hidden_layers": 1, "model_type": "llama", "dtype": "bfloat16"}
    (model_dir / "config.json").write_text(json.dumps(config))
    model = load_model(model_dir, dtype=torch.bfloat16, progress=False, load_format="dummy")
    platform = EmulatedFlashInferPlatform(use_tensor_cores=True)
    max_len = ctx + 256
    cfg = ExecutorConfig(
        dtype=torch.bfloat16, block_size=BLOCK, max_num_seqs=batch, max_model_len=max_len,
        decode_graph_sizes=(batch,), piecewise_token_sizes=(),
    )  # fmt: skip
    executor = ModelExecutor(model, platform, cfg)
    if graphs_class is not None:  # an earlier tree's decode graphs on the same executor
        executor.decode_graphs = graphs_class(platform, executor.backends, cfg, executor._forward)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=batch * (max_len // BLOCK) + 1))
    return executor


def _steps(batch: int, ctx: int, count: int) -> list[tuple]:
    """``count`` decode steps of ``batch`` sequences, each with ``ctx`` tokens cached before."""
    from xhal.interfaces import AttentionMetadata, BatchKind

    pages = ctx // BLOCK + 16
    table_ = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages) + 1
    out = []
    for i in range(count):
        kv = torch.full((batch,), ctx + 1 + i, dtype=torch.int32)
        ones = torch.ones(batch, dtype=torch.int32)
        pos = kv - 1
        slots = table_.gather(1, (pos // BLOCK).long().view(-1, 1)).view(-1) * BLOCK + pos % BLOCK
        meta = AttentionMetadata.from_host_lengths(BatchKind.DECODE, ones, kv, table_, slots.int())
        out.append((torch.full((batch,), 7, dtype=torch.int32), pos.clone(), meta))
    return out


def measure(batch: int, ctx: int, steps: int = 64, shape: dict = CONFIG, graphs_class=None) -> dict:
    """Three runs of ``steps`` consecutive steps (page crossings at their natural rate): the
    staging and the attention plan timed apart, then whole ``execute`` calls, then counted.
    ``shape``: the model config (one layer of it is built); ``graphs_class``: another tree's
    ``DecodeGraphs`` (``host_timing.baseline_graphs``)."""
    executor = _executor(batch, ctx, shape, graphs_class)
    work = _steps(batch, ctx, 3 * steps + 1)
    executor.execute(*work[0])  # captures the bucket
    graphs, key = executor.decode_graphs, ("decode", batch)
    static = graphs.graphs.replay(key)
    graphs.graphs.replay = lambda k: static  # the host's time alone
    backend = executor.backends[0]
    stage, plan, whole, ops, copies = [], [], [], [], []
    for ids, pos, meta in work[1 : steps + 1]:
        t0 = time.perf_counter()
        padded = graphs._stage(ids, pos, meta, batch)
        t1 = time.perf_counter()
        backend.plan(padded, graph_key=key)
        stage.append((t1 - t0) * 1e6)
        plan.append((time.perf_counter() - t1) * 1e6)
    for ids, pos, meta in work[steps + 1 : 2 * steps + 1]:
        t0 = time.perf_counter()
        executor.execute(ids, pos, meta)
        whole.append((time.perf_counter() - t0) * 1e6)
    for ids, pos, meta in work[2 * steps + 1 :]:
        with DeviceCalls() as calls:
            executor.execute(ids, pos, meta)
        ops.append(len(calls.ops))
        copies.append(calls.copies)
    return {
        "batch": batch, "ctx": ctx, "stage_us": statistics.median(stage),
        "attention_plan_us": statistics.median(plan),
        "plan_p95_us": sorted(plan)[int(0.95 * steps)],
        "execute_us": statistics.median(whole), "execute_p95_us": sorted(whole)[int(0.95 * steps)],
        "ops_per_step": statistics.median(ops), "ops_max": max(ops),
        "copy_pairs_per_step": statistics.median(copies),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each tree, interleaved")
    parser.add_argument("--baseline", type=Path, help="root of an earlier tree to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trees = {"this tree": None}
    if args.baseline is not None:
        trees["baseline"] = baseline_graphs(args.baseline)
    rows = []
    for b in args.batches:
        for repeat in range(args.repeats):  # interleaved, so a noisy spell hits both trees
            for name, graphs_class in trees.items():
                row = measure(b, args.ctx, args.steps, graphs_class=graphs_class)
                rows.append({"tree": name, "repeat": repeat, **row})
                gc.collect()  # each executor holds a model and caches of its own: GBs at 8B
    print(
        table(
            rows,
            "graph decode step, host side (CPU, FlashInfer emulated, replay stubbed; "
            f"{args.steps} steps each); copy pairs: cudaMemcpyAsync calls on a GPU from host "
            "tensors",
        )
    )


if __name__ == "__main__":
    main()
