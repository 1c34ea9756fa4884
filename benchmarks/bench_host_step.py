"""Host time inside ``ModelExecutor.execute`` per CUDA-graph decode step, the number the host-path
issue targets (at most 60 us at batch 1 and 64), on a Llama-3-shaped model with random bf16
weights at ctx 2K, with the pipelined step it hides behind and that step against its read floor
(bytes really read / read-only streaming rate of the same run).

Each repeat is the median of ``--steps`` calls entered with the device idle (a synchronize
first: ``host_timing.host_time_us``); the repeats are reported apart since the host is noisy.
The caller's block table is as wide as its sequences (128 pages), narrower than the executor's
persistent one, as a server's usually is. Every step is checked against the eager executor on
the same weights and caches first. ``--baseline DIR`` also runs the decode graphs of an earlier
tree (``DIR/xhal/executor/decode_graph.py``, loaded beside this tree's) on the same model,
caches and kernels, repeats interleaved: a before/after in one process. ``--inputs`` says where
the step's tensors are handed over: ``host`` (as a host builds them; the graphs stage them in one
pinned copy) and ``device`` (already uploaded), both by default, ``served`` (host tensors but
for the ids, the tokens the step before sampled into the executor's ``token_ids``, read in place:
xhal-serve's steady decode step; this tree only, not ``--baseline``'s) or ``ids64`` (the same
with the tokens as int64 in a tensor of their own, copied in after the pinned copy). Last,
the CUDA runtime calls of one step, outside the graph, counted with the profiler (after every
timing: once the profiler has run in a process, CUDA calls cost more).

    python -m benchmarks.bench_host_step [--shapes llama3-8b llama3.2-1b] [--batches 1 64]
        [--repeats 5] [--steps 200] [--baseline DIR] [--parts] [--calls]
        [--inputs host served ids64 device]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import torch

import xhal
from benchmarks.bench_model import (
    BLOCK,
    CTX,
    SHAPES,
    decode_metadata,
    decode_read_bytes,
    random_model,
)
from benchmarks.common import read_bandwidth, table, time_cuda_pipelined
from benchmarks.host_timing import (
    baseline_graphs,
    call_breakdown,
    host_breakdown,
    host_time_us,
)
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.interfaces import AttentionMetadata

# runtime calls that queue device work (the graph launch included)
_QUEUEING = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaGraphLaunch")


def on_host(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> tuple:
    """The step as a host builds it, every tensor in host memory (the decode graphs stage it in
    one pinned copy)."""
    host = AttentionMetadata.from_host_lengths(
        meta.kind, meta.q_seq_lens_host, meta.kv_seq_lens_host, meta.block_table.cpu(),
        meta.slot_mapping.cpu(), max_seq_len=meta.max_seq_len,
    )  # fmt: skip
    return ids.cpu(), pos.cpu(), host


def _sampled_into(executor: ModelExecutor, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` written where xhal-serve's sampler leaves a step's tokens: the executor's
    ``token_ids``, which the next decode step reads in place."""
    graphs = executor.decode_graphs
    buffer = executor.token_ids(ids.shape[0]) if hasattr(graphs, "token_ids") else None
    if buffer is None:
        raise SystemExit("--inputs served needs decode graphs with token_ids (this tree's)")
    return buffer.copy_(ids)


def _runtime_calls(executor: ModelExecutor, ids, pos, meta) -> str:
    """The CUDA runtime calls one ``execute`` makes that queue device work, by name."""
    from torch.profiler import ProfilerActivity, profile

    executor.execute(ids, pos, meta)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        executor.execute(ids, pos, meta)
        torch.cuda.synchronize()
    counts = {e.key: e.count for e in prof.key_averages() if e.key in _QUEUEING}
    return " + ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"


def measure_shape(
    shape: str, batches: list[int], args, read_rate: float
) -> tuple[list[dict], list[tuple]]:
    """The rows of one shape, and (row index, executor, step) for the runtime-call count."""
    platform = xhal.platforms.get("cuda")
    device, config = platform.device(), SHAPES[shape]
    model = random_model(device, config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = ExecutorConfig(
        dtype=torch.bfloat16, block_size=BLOCK, max_num_seqs=max(batches),
        max_model_len=CTX + 64, decode_graph_sizes=tuple(batches),
    )  # fmt: skip
    trees = {"this tree": ModelExecutor(model, platform, cfg)}
    if args.baseline is not None:
        baseline = ModelExecutor(model, platform, cfg)
        baseline.decode_graphs = baseline_graphs(args.baseline)(
            platform, baseline.backends, cfg, baseline._forward
        )
        trees["baseline"] = baseline
    eager = ModelExecutor(model, platform, dataclasses.replace(cfg, enforce_eager=True))
    caches = eager.allocate_kv_caches(num_blocks=max(batches) * CTX // BLOCK + 64)
    for ex in (eager, *trees.values()):
        ex.bind_kv_caches(caches)
        if ex is not eager:
            ex.capture_graphs(progress=False)
    rows, steps = [], []
    for batch in batches:
        ids, pos, meta = decode_metadata(batch, CTX, device, config["vocab_size"])
        reference = eager.compute_logits(eager.execute(ids, pos, meta))
        read = decode_read_bytes(config, weight_bytes, batch, CTX)
        read_floor_ms = read["honest"] / read_rate * 1e3
        host = on_host(ids, pos, meta)
        # as xhal-serve hands a steady decode step: host tensors but for the ids, the tokens the
        # step before sampled into the executor's token_ids (read in place); ids64: the same
        # tokens as int64 in a tensor of their own (copied in: a host that samples elsewhere)
        shared = {"device": (ids, pos, meta), "host": host, "ids64": (ids.long(), *host[1:])}
        handed = {}
        for name, ex in trees.items():
            for inputs in args.inputs:
                handed[name, inputs] = shared.get(inputs) or (_sampled_into(ex, ids), *host[1:])
        runs = [(name, inputs) for name in trees for inputs in args.inputs]
        per_run: dict[tuple[str, str], dict] = {}
        first = None  # the first run's logits: every other run's must be the same bits
        for name, inputs in runs:
            ex, step_args = trees[name], handed[name, inputs]
            logits = ex.compute_logits(ex.execute(*step_args))
            err = float((logits - reference).abs().max() / reference.abs().max())
            first = logits if first is None else first
            step = lambda ex=ex, a=step_args: ex.compute_logits(ex.execute(*a))  # noqa: E731
            pipelined = time_cuda_pipelined(step)
            per_run[name, inputs] = {
                "err": err, "same_as_first": bool(torch.equal(logits, first)),
                "pipelined_ms": pipelined, "host": [],
            }  # fmt: skip
        for _ in range(args.repeats):  # interleaved, so a noisy spell hits every run
            for name, inputs in runs:
                per_run[name, inputs]["host"].append(
                    host_time_us(trees[name], [handed[name, inputs]], iters=args.steps)
                )
        if args.parts:  # where it goes, and how the way the call is entered changes it
            for name, inputs in runs:
                ex, step = trees[name], [handed[name, inputs]]
                parts = host_breakdown(ex, *step[0], iters=args.steps)
                inflight = host_breakdown(ex, *step[0], args.steps, "inflight")
                per_run[name, inputs]["parts"] = {
                    **parts,
                    **{f"inflight_{k}": v for k, v in inflight.items()},
                    "host_spun_us": host_time_us(ex, step, args.steps, "spun"),
                    "host_busy_us": host_time_us(ex, step, 50, "busy"),
                    "host_inflight_us": host_time_us(ex, step, args.steps, "inflight"),
                }
        if args.calls:  # every timed call's exclusive host time, per run (idle and in flight)
            for name, inputs in runs:
                for mode in ("idle", "inflight"):
                    step = handed[name, inputs]
                    calls = call_breakdown(trees[name], *step, iters=50, mode=mode)
                    title = f"--- {shape} batch {batch}, {name}, {inputs} inputs, {mode}: calls"
                    print(table(calls, title))
        for (name, inputs), r in per_run.items():
            steps.append((len(rows), trees[name], handed[name, inputs]))
            rows.append({
                "shape": shape, "batch": batch, "tree": name, "inputs": inputs,
                "host_us_median": statistics.median(r["host"]),
                "host_us_runs": " ".join(f"{v:.1f}" for v in r["host"]),
                "pipelined_ms": r["pipelined_ms"], "read_floor_ms": read_floor_ms,
                "x_read_floor": r["pipelined_ms"] / read_floor_ms,
                "max_rel_err_vs_eager": r["err"], "bitwise_as_first_run": r["same_as_first"],
                **r.get("parts", {}),
            })  # fmt: skip
    return rows, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama3-8b"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--baseline", type=Path, help="root of an earlier tree to compare with")
    parser.add_argument(
        "--inputs",
        nargs="+",
        choices=["host", "served", "ids64", "device"],
        default=["host", "device"],
        help="where the step's tensors are handed to execute: host (as a host builds them: one "
        "pinned copy inside execute), served (host, but the ids are the tokens the step before "
        "sampled into the executor's token_ids, as xhal-serve hands a steady decode step), ids64 "
        "(the same, the tokens int64 in a tensor of their own) or device (already uploaded: one "
        "multi-tensor copy)",
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also the staging / plan / replay / rest split, timed inside whole calls so a "
        "sample's parts add up to it (idle entry and with the same step in flight ahead, the "
        "served regime), and whole calls entered after 2 ms of spinning (spun), with 20 ms of "
        "device work queued (busy, 50 calls) or with the step in flight (inflight)",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also each timed call's exclusive host time per step, entered idle and in flight "
        "(host_timing.call_breakdown: the staging routes, the event wait and record, copies, "
        "plan, replay)",
    )
    args = parser.parse_args()
    read_rate = read_bandwidth()["read"]
    print(f"read ceiling {read_rate / 1e12:.2f} TB/s")
    rows, counted = [], []
    for shape in args.shapes:
        shape_rows, steps = measure_shape(shape, args.batches, args, read_rate)
        print(table(shape_rows, f"--- {shape}"), flush=True)
        counted += [(shape_rows[i], ex, step) for i, ex, step in steps]
        rows += shape_rows
    for row, ex, step in counted:  # last: the profiler slows every later CUDA call of a process
        row["runtime_calls_per_step"] = _runtime_calls(ex, *step)
    print(
        table(
            rows,
            f"host us inside execute per graph decode step (median of {args.steps} idle-entry "
            f"calls, {args.repeats} runs), ctx {CTX}, bf16; pipelined step against its read floor",
        )
    )


if __name__ == "__main__":
    main()
