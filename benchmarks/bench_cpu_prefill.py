"""A long prefill (prefix cache off) through xhal's engine on ``cpu-fast``, with its native
prefill paths and without them, against transformers, interleaved in one process: the A/B that
bench_cpu_vs_hf's prefill row cannot give on a shared machine.

    python -m benchmarks.bench_cpu_prefill [--model builtin|random|DIR] [--threads N]
        [--tokens 1300] [--reps 8] [--clock wall|thread] [--apart]

Sides: ``xhal`` (as served), ``xhal/mkl+sdpa`` (the same engine with no packed copy serving,
``packed.disabled``, and torch's SDPA for the prefill chunk, ``calls.sdpa_prefill``: MKL's GEMM
and torch's CPU flash attention, the prefill paths before the native ones) and ``hf``
(transformers ``generate`` of one token); ``--apart`` adds the two settings alone,
``xhal/mkl`` and ``xhal/sdpa``. Each repetition runs every side once, the side that
goes first rotating; the table has each side's median and quickest, and the ratios of medians
and of each repetition's times; the load average before and after. The first generated token
is compared across sides.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_cpu_vs_hf import _prompt, hf_side, model_dir, xhal_side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin", help="builtin | random | checkpoint dir")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=1300)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument(
        "--apart",
        action="store_true",
        help="also each of the two settings alone: xhal/mkl (no packed copy) and xhal/sdpa",
    )
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts one thread's CPU time: use it with --threads 1")
    from xhal.platforms.cpu_fast import packed
    from xhal.platforms.cpu_fast.kernels import calls

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(args.model, Path(tmp) / "smollm2-135m-shape")
        engine_args = argparse.Namespace(concurrency=1, enforce_eager=False)
        xhal_timed, close = xhal_side(directory, engine_args, clock)
        hf_timed, model = hf_side(directory, clock)

        def under(*settings):
            def timed(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
                with contextlib.ExitStack() as stack:
                    for setting in settings:
                        stack.enter_context(setting())
                    return xhal_timed(prompts, n)

            return timed

        sides = {
            "xhal": xhal_timed,
            "xhal/mkl+sdpa": under(packed.disabled, calls.sdpa_prefill),
            "hf": hf_timed,
        }
        if args.apart:
            sides |= {"xhal/mkl": under(packed.disabled), "xhal/sdpa": under(calls.sdpa_prefill)}
        prompt = _prompt(args.tokens, 1, model.config.vocab_size)
        firsts = {name: timed([prompt], 1)[1][0] for name, timed in sides.items()}  # warm-up
        load_before = os.getloadavg()[0]
        times: dict[str, list[float]] = {name: [] for name in sides}
        for rep in range(args.reps):
            order = list(sides)[rep % len(sides) :] + list(sides)[: rep % len(sides)]
            for name in order:
                times[name].append(sides[name]([prompt], 1)[0])
        load_after = os.getloadavg()[0]
        close()
    print(
        f"{args.tokens}-token prefill, CPU, {args.threads} thread(s), {directory.name} (float32), "
        f"{args.clock} clock, {args.reps} interleaved reps; 1-min load {load_before:.2f} before, "
        f"{load_after:.2f} after, on {os.cpu_count()} CPUs"
    )
    print(f"{'':<16}{'median (s)':>12}{'quickest':>10}")
    for name, ts in times.items():
        print(f"{name:<16}{statistics.median(ts):>12.3f}{min(ts):>10.3f}")
    pairs = [("hf", "xhal"), ("xhal/mkl+sdpa", "xhal"), ("hf", "xhal/mkl+sdpa")]
    if args.apart:
        pairs += [("xhal/mkl", "xhal"), ("xhal/sdpa", "xhal")]
    for slow, fast in pairs:
        per_rep = [s / f for s, f in zip(times[slow], times[fast])]
        ratio = statistics.median(times[slow]) / statistics.median(times[fast])
        print(
            f"{slow} / {fast}: {ratio:.2f}x of medians, per rep "
            + " ".join(f"{r:.2f}" for r in per_rep)
        )
    print("first token identical:", len({tuple(ids) for ids in firsts.values()}) == 1, firsts)


if __name__ == "__main__":
    main()
