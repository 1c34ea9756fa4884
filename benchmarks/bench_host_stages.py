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
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from pathlib import Path

import torch

ENGINE_STAGES = ("schedule", "input build", "upload", "execute", "logits", "sample", "output",
                 "ipc send")  # fmt: skip
API_STAGES = ("ipc receive", "detokenize")
STAGES = ENGINE_STAGES + API_STAGES


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint dir (default: the built-in model)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--label", default="", help="printed in the table's title (e.g. main, branch)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # shared CI machines: comparable numbers, not peak ones
    model_dir = args.model
    if model_dir is None:
        from serve_cli.default_model import ensure_default_model

        model_dir = ensure_default_model()
    results = {b: measure(model_dir, b, args.steps) for b in args.batch}
    print(
        f"host time per decode step, median us ({args.label or 'this checkout'}, {model_dir.name})"
    )
    print(f"{'stage':<14}" + "".join(f"{'batch ' + str(b):>12}" for b in args.batch))
    for name in STAGES:
        print(f"{name:<14}" + "".join(f"{results[b][name]:>12.0f}" for b in args.batch))
    host = [s for s in ENGINE_STAGES if s not in ("execute", "logits")]
    print(
        f"{'engine host':<14}"
        + "".join(f"{sum(results[b][s] for s in host):>12.0f}" for b in args.batch)
    )
    print(
        f"{'api process':<14}"
        + "".join(f"{sum(results[b][s] for s in API_STAGES):>12.0f}" for b in args.batch)
    )
    print("(execute and logits include the CPU's compute; engine host leaves them out; the API")
    print(" process's stages run there, off the engine's step loop)")


if __name__ == "__main__":
    main()
