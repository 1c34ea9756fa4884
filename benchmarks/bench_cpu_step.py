"""Where a CPU decode step's time goes: the step against the matrix products it cannot
do without, per layer, on each platform given, all in one run on one loaded model.

    python -m benchmarks.bench_cpu_step [--model builtin|random|narrow|DIR]
        [--platforms cpu-fast cpu-fast/torch cpu]
        [--threads N] [--batch 1] [--steps 30] [--context 64] [--clock wall|thread]
        [--profile [--top N]]

For each platform (in the order given; the model's weights are the ones the last
``prepare_weights`` left, so list ``cpu-fast`` first to time the reference on them too), on
an executor with that platform's ops active: the median of ``--steps`` decode steps of
``--batch`` sequences (``execute``, ``compute_logits`` and the greedy pick, as ``xhal-serve``
runs them) at ``--context`` tokens each, and, interleaved with them, the same step's matrix
products alone (the platform's ``linear`` of ``--batch`` rows on every projection of every
layer and on the LM head, in step order, on the weights as stored, packed copies included): what
is left over, divided by the number of layers, is the per-layer overhead (norms, rotary, the KV
write, attention, activation and every Python and dispatch layer around them). The floor is the
bytes a step reads (weights once, the tied head's table once, K and V of the context) over the
streaming-read ceiling measured in the same run (``bench_cpu_vs_hf.read_ceiling``).
``cpu-fast/torch`` is cpu-fast with its native kernels off (``native.torch_path``): the torch
path it had before them, for a before / after in one run; ``cpu-fast/mkl`` is cpu-fast
with no packed copy serving (``packed.disabled``): MKL's GEMM for every product of a batch, as
before the native small-batch GEMM. A step ends with the greedy pick of its logits, as in a served
greedy request.
``--model narrow`` is SmolLM2-135M's layer count, heads and head dim with hidden and intermediate
sizes of 72 and 64 (seeded random weights, 12 MB): its step is almost all per-op overhead, which
shared machines disturb far less than the memory-bound products; the ``min`` column (the fastest
step) is the steadiest figure there.
``--clock thread`` (with ``--threads 1``) times by this thread's CPU time, which other processes
on a shared machine inflate less than the wall clock (their memory traffic still slows the
products). ``--profile`` adds torch.profiler's op count per step and its top ops by self time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from benchmarks.bench_cpu_vs_hf import SMOLLM2_135M, model_dir, read_ceiling

BLOCK = 16
# SmolLM2-135M's depth, heads and head dim, narrow everywhere else: a step that is all overhead
NARROW = {**SMOLLM2_135M, "hidden_size": 72, "intermediate_size": 64, "vocab_size": 256}


def _narrow_checkpoint(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**NARROW)).save_pretrained(out, safe_serialization=True)
    return out


def _us(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return (clock() - start) * 1e6


def _matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every projection matrix a decode step multiplies by, in step order, then the LM head."""
    mats = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mats += [attn.qkv_proj.weight, attn.o_proj.weight]
        mats += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
    return [*mats, model.lm_head.weight]


def _step_bytes(model: torch.nn.Module, context: int, batch: int) -> int:
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # the tied table once
    total = sum(p.numel() * p.element_size() for p in params)
    spec = model.model.layers[0].self_attn.attn
    kv_row = 2 * spec.num_kv_heads * spec.head_dim * 4
    return total + len(model.model.layers) * context * kv_row * batch


class DecodeStep:
    """One executor on ``platform`` over ``model``, decoding ``batch`` sequences at ``context``
    tokens each (each in blocks of its own, consecutive)."""

    def __init__(
        self, model: torch.nn.Module, platform_name: str, context: int, batch: int = 1
    ) -> None:
        from xhal import platforms
        from xhal.executor import ExecutorConfig, ModelExecutor
        from xhal.interfaces.metadata import AttentionMetadata, BatchKind

        base, _, variant = platform_name.partition("/")
        if variant not in ("", "torch", "mkl"):
            raise SystemExit(f"{platform_name!r}: the variants are cpu-fast/torch and cpu-fast/mkl")
        self.variant = variant
        self.platform = platforms.get(base)
        config = ExecutorConfig(
            dtype=torch.float32, block_size=BLOCK, max_num_seqs=batch, max_model_len=4 * context,
            max_num_batched_tokens=4 * context * batch, enforce_eager=True,
        )  # fmt: skip
        blocks = -(-context // BLOCK)
        with self.active():
            self.executor = ModelExecutor(model, self.platform, config)
            caches = self.executor.allocate_kv_caches(batch * blocks + 1)
            self.executor.bind_kv_caches(caches)
        table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        slots = table[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
        self.metadata = AttentionMetadata.from_host_lengths(
            BatchKind.DECODE,
            torch.ones(batch, dtype=torch.int32),
            torch.full((batch,), context, dtype=torch.int32),
            table,
            slots.int(),
        )
        self.ids = torch.full((batch,), 5, dtype=torch.int32)
        self.positions = torch.full((batch,), context - 1, dtype=torch.int32)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from xhal import ops
        from xhal.platforms.cpu_fast import packed
        from xhal.platforms.cpu_fast.kernels import native

        variants = {"torch": native.torch_path, "mkl": packed.disabled}
        variant = variants.get(self.variant, contextlib.nullcontext)
        with ops.using("cpu", self.platform.ops), variant():
            yield

    def __call__(self) -> torch.Tensor:
        from xhal import ops

        with self.active():
            hidden = self.executor.execute(self.ids, self.positions, self.metadata)
            return ops.argmax(self.executor.compute_logits(hidden))


def products(
    mats: list[torch.Tensor], batch: int, linear: Callable, active: Callable
) -> Callable[[], None]:
    """The step's products alone, inside ``active()`` (the variant's switches: packed copies
    off for cpu-fast/mkl, as in its steps)."""
    rows = {m.shape[1]: torch.randn(batch, m.shape[1]) for m in mats}

    def run() -> None:
        with active():
            for m in mats:
                linear(rows[m.shape[1]], m)

    return run


def profile(step: DecodeStep, top: int, steps: int = 5) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    count = sum(e.count for e in events if e.key.startswith("aten::"))
    print(f"  {count / steps:.0f} aten ops per step; top by self CPU time (us per step):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.key:<48}{e.count / steps:>8.0f} calls{e.self_cpu_time_total / steps:>10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin", help="builtin | random | checkpoint dir")
    parser.add_argument("--platforms", nargs="+", default=["cpu-fast", "cpu-fast/torch", "cpu"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per decode step")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=15, help="ops --profile lists")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts one thread's CPU time: use it with --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    from models.loader import load_model

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "narrow":
            directory = _narrow_checkpoint(Path(tmp) / "smollm2-135m-narrow")
        else:
            directory = model_dir(args.model, Path(tmp) / "smollm2-135m-shape")
        model = load_model(directory, torch.float32, "cpu", progress=False).eval()
    num_layers = len(model.model.layers)
    ceiling = read_ceiling()
    step_bytes = _step_bytes(model, args.context, args.batch)
    floor_us = step_bytes / ceiling * 1e6
    results = {}
    with torch.inference_mode():
        runs = {}
        for name in args.platforms:
            step = DecodeStep(model, name, args.context, args.batch)
            gemv = products(
                _matrices(model), args.batch, step.platform.ops.linear, step.active
            )
            for _ in range(3):  # warm-up: first calls allocate and pack
                step(), gemv()
            runs[name] = (step, gemv, [], [])
        for _ in range(args.steps):  # interleaved, platforms too: load changes hit them all
            for step, gemv, step_us, gemv_us in runs.values():
                step_us.append(_us(step, clock))
                gemv_us.append(_us(gemv, clock))
        for name, (step, _, step_us, gemv_us) in runs.items():
            results[name] = (
                statistics.median(step_us), statistics.median(gemv_us), min(step_us)
            )
            if args.profile:
                print(f"{name}:")
                profile(step, args.top)
    print(
        f"CPU, {args.threads} thread(s), {directory.name} float32, batch {args.batch}, context "
        f"{args.context}, {args.clock} clock, median of {args.steps} steps; 1-min load average "
        f"{load_before:.2f} "
        f"before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs"
    )
    print(f"floor: {step_bytes / 1e6:.0f} MB per step / read ceiling "
          f"{ceiling / 1e9:.1f} GB/s = {floor_us / 1e3:.1f} ms")  # fmt: skip
    print(f"{'platform':<22}{'step ms':>9}{'min ms':>8}{'tok/s':>8}{'products ms':>13}"
          f"{'overhead/step ms':>18}{'overhead/layer us':>19}{'floor/step':>12}")  # fmt: skip
    for name, (step_us, gemv_us, fastest_us) in results.items():
        print(
            f"{name:<22}{step_us / 1e3:>9.1f}{fastest_us / 1e3:>8.1f}"
            f"{args.batch * 1e6 / step_us:>8.1f}{gemv_us / 1e3:>13.1f}"
            f"{(step_us - gemv_us) / 1e3:>18.1f}"
            f"{(step_us - gemv_us) / num_layers:>19.0f}{floor_us / step_us:>11.0%}"
        )


if __name__ == "__main__":
    main()
