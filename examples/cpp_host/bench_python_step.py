"""The Python host's executor step on the batch the C++ host's benchmark runs, for comparison.

Builds the model and executor exactly as ``xhal_cpp_host`` does (same config, graphs captured,
warm-up), prefills ``B`` synthetic prompts in one step, then times decode steps through the
reference server's path: ``InputBuilder.upload`` (xLLM layout through ``xhal.adapter``), one
``execute``, one ``compute_logits``, argmax and the read-back of the tokens. Also times an
EMPTY ``execute`` called from Python, the device-free floor the C++ crossing is compared with.

    python examples/cpp_host/bench_python_step.py --model DIR --device cuda --load-format dummy \
        --batch 8 --prompt-len 512 --decode-steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def synthetic_prompt(r: int, prompt_len: int, vocab: int) -> list[int]:
    # the same ids as xhal_cpp_host --synthetic
    return [(r * 131 + j * 31 + 7) % vocab for j in range(prompt_len)]


def main() -> None:
    from models.loader import load_model
    from serve_cli.engine.runner.input_builder import HostStep, InputBuilder
    from xhal import platforms
    from xhal.adapter.to_xllm import to_xllm
    from xhal.executor import ExecutorConfig, ModelExecutor

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--convention", default="cuda", choices=["cuda", "npu"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--crossing-iters", type=int, default=2000)
    p.add_argument("--eager", action="store_true")
    a = p.parse_args()

    platform = platforms.get(a.device)
    device = platform.device()
    model = load_model(a.model, a.dtype, device, progress=False, load_format=a.load_format)
    config = ExecutorConfig(
        dtype=next(model.parameters()).dtype, block_size=a.block_size, max_num_seqs=a.batch,
        max_model_len=a.max_model_len, enforce_eager=a.eager, metadata_convention=a.convention,
    )
    executor = ModelExecutor(model, platform, config)
    bs = a.block_size
    per_seq = config.max_blocks_per_seq
    executor.bind_kv_caches(executor.allocate_kv_caches(a.num_blocks or a.batch * per_seq))
    if executor.decode_graphs is not None and platform.device_type != "cpu":
        executor.capture_graphs(progress=False)
        executor.warm_up()
    vocab = int(
        model.config["vocab_size"] if isinstance(model.config, dict) else model.config.vocab_size
    )
    builder = InputBuilder(device, a.convention, bs)

    prompts = [synthetic_prompt(r, a.prompt_len, vocab) for r in range(a.batch)]
    blocks = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(a.batch)]
    lens = [0] * a.batch
    last: list[int] = []

    def step(chunks: list[list[int]]) -> list[int]:
        ids, pos, slots, q, kv, table, selected = [], [], [], [], [], [], []
        for r, tokens in enumerate(chunks):
            start = lens[r]
            ids += tokens
            pos += range(start, start + len(tokens))
            slots += [blocks[r][t // bs] * bs + t % bs for t in range(start, start + len(tokens))]
            lens[r] += len(tokens)
            q.append(len(tokens))
            kv.append(lens[r])
            table.append(blocks[r][: -(-lens[r] // bs)])
            selected.append(len(ids) - 1)
        host = HostStep(ids, pos, q, kv, table, slots, selected, [str(r) for r in range(a.batch)])
        inputs = builder.upload(host)
        hidden = executor.execute(inputs.input_ids, inputs.positions, inputs.metadata)
        logits = executor.compute_logits(hidden, inputs.selected_idxes)
        return logits.argmax(-1).tolist()

    last = step(prompts)  # the prefill, as the C++ host schedules it
    first_tokens = [last[0]]
    times = []
    for _ in range(a.decode_steps):
        t0 = time.perf_counter()
        last = step([[t] for t in last])
        times.append(time.perf_counter() - t0)
        first_tokens.append(last[0])
    steady = times[1:]  # as the C++ host's summary, the first decode step is left out

    empty = to_xllm(
        [], [], [], [], a.convention, device, block_size=bs if a.convention == "cuda" else None
    )
    no_tokens = torch.zeros(0, dtype=torch.int32, device=device)
    empty_times = []
    for _ in range(a.crossing_iters):
        t0 = time.perf_counter()
        executor.execute(no_tokens, no_tokens, empty)
        empty_times.append(time.perf_counter() - t0)
    print("tokens r0:", *first_tokens)  # xhal_cpp_host prints the same line for request 0
    print(
        f"python-decode-steps seqs={a.batch} n={len(steady)} "
        f"step_us_median={statistics.median(steady) * 1e6:.1f} "
        f"empty_execute_us_median={statistics.median(empty_times) * 1e6:.2f}"
    )


if __name__ == "__main__":
    main()
