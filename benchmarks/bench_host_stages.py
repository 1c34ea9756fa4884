"""Per-stage host time of a served decode step on the CPU: the stages ``EngineCore.step`` runs,
timed one by one on a real engine in steady decode.

    python -m benchmarks.bench_host_stages [--model DIR] [--batch 1 32] [--steps 30]

Stages, in the order a synchronous step runs them: scheduling (``Scheduler.next_batch``), input
build (``InputBuilder.describe``: the batch flattened for the host), upload (``InputBuilder.upload``:
xLLM layout, adapter, host-to-device copy), execute (``ModelExecutor.execute``; on the CPU this is the
model's compute too, not only host work), logits, sampling (launch + read back), detokenization
(``IncrementalDetokenizer.add_token`` of the step's tokens) and output processing (scheduler
bookkeeping and outputs). Medians over ``--steps`` decode steps, in microseconds. The script only
calls engine pieces that exist on main too, so the same file measures main (run it with main's
checkout first on ``PYTHONPATH``) and the branch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

STAGES = ("schedule", "input build", "upload", "execute", "logits", "sample", "detokenize", "output")


def _engine(model_dir: Path, batch: int):
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.core import EngineCore

    return EngineCore(EngineConfig(
        model_dir=model_dir, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048,
        max_model_len=1024, num_kv_blocks=max(64, batch * 8), enable_prefix_caching=False,
        async_scheduling=False, enforce_eager=True,
    ))


def measure(model_dir: Path, batch: int, steps: int, prompt_len: int = 32) -> dict[str, float]:
    """Median microseconds per stage over ``steps`` decode steps of ``batch`` requests."""
    from serve_cli.engine.sampling import SamplingParams

    engine = _engine(model_dir, batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(3, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(3):  # prefill, then a few decodes so every request decodes
        engine.step()
    runner, scheduler = engine.runner, engine.scheduler
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
        states = {r: engine._states[r] for r in rids}
        pending = runner.sampler.launch(logits, [states[r].params for r in rids], [None] * len(rids))
        tokens, _ = pending.resolve()
        t7 = time.perf_counter()
        for r, token in zip(rids, tokens):
            states[r].detokenizer.add_token(token)
        t8 = time.perf_counter()
        scheduler.advance(batch_, dict(zip(rids, tokens)), {})
        t9 = time.perf_counter()
        spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t7 - t5, t8 - t7, t9 - t8)
        for name, span in zip(STAGES, spans):
            times[name].append(span * 1e6)
    engine.close()
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the built-in model)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--label", default="", help="printed in the table's title (e.g. main, branch)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # shared CI machines: comparable numbers, not peak ones
    model_dir = args.model
    if model_dir is None:
        from serve_cli.default_model import ensure_default_model

        model_dir = ensure_default_model()
    results = {b: measure(model_dir, b, args.steps) for b in args.batch}
    print(f"host time per decode step, median us ({args.label or 'this checkout'}, {model_dir.name})")
    print(f"{'stage':<14}" + "".join(f"{'batch ' + str(b):>12}" for b in args.batch))
    for name in STAGES:
        print(f"{name:<14}" + "".join(f"{results[b][name]:>12.0f}" for b in args.batch))
    host = [s for s in STAGES if s not in ("execute", "logits")]
    print(f"{'host total':<14}" + "".join(f"{sum(results[b][s] for s in host):>12.0f}" for b in args.batch))
    print("(execute and logits include the CPU's compute; host total leaves them out)")


if __name__ == "__main__":
    main()
