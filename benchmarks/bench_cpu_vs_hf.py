"""xhal's engine (what ``xhal-serve --device cpu`` runs, in process, without HTTP) against
transformers ``generate`` on the same random-weight SmolLM2-135M-shaped checkpoint, same machine,
same thread count, side by side: batch-1 decode rate, a long prefill (prefix cache off) and the
aggregate rate of concurrent requests; greedy token ids are compared.

    python -m benchmarks.bench_cpu_vs_hf [--threads N] [--decode-tokens 64] [--prefill-tokens 1300]
        [--concurrency 8] [--rounds 3] [--enforce-eager] [--dir DIR]

``--device cpu`` serves on ``cpu-fast``; ``XHAL_SERVE_CPU_PLATFORM=cpu`` measures the reference
platform instead (the figures before ``cpu-fast``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

# SmolLM2-135M(-Instruct)'s architecture; the weights here are random, so the text is noise
SMOLLM2_135M = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


def make_checkpoint(out: Path) -> Path:
    """A float32 checkpoint of that shape (seeded random weights) with the built-in model's
    tokenizer (its ids fall inside the vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from serve_cli.default_model import ensure_default_model

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for path in ensure_default_model().iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)
    return out


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SMOLLM2_135M["vocab_size"], (n,), generator=g).tolist()


def xhal_side(model_dir: Path, args: argparse.Namespace):
    """``timed(prompts, n) -> (seconds, ids of the first prompt)`` on xhal's engine, and its
    close."""
    from serve_cli.engine.config import EngineConfig
    from serve_cli.engine.core import EngineCore
    from serve_cli.engine.offline import generate
    from serve_cli.engine.sampling import SamplingParams

    engine = EngineCore(
        EngineConfig(
            model_dir=model_dir,
            device="cpu",
            dtype="float32",
            max_model_len=2048,
            max_num_batched_tokens=2048,
            max_num_seqs=max(args.concurrency, 1),
            num_kv_blocks=1024,
            enable_prefix_caching=False,
            enforce_eager=args.enforce_eager,
        )
    )

    def timed(prompts: list[list[int]], n: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        out = generate(engine, prompts, params)
        return time.perf_counter() - start, out[0]

    return timed, engine.close


def hf_side(model_dir: Path, args: argparse.Namespace):
    """The same ``timed`` on transformers ``generate``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def timed(prompts: list[list[int]], n: int) -> tuple[float, list[int]]:
        ids = torch.tensor(prompts)  # prompts of one length: no padding
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start, out[0, ids.shape[1] :].tolist()

    return timed, lambda: None


def measure(timed, args: argparse.Namespace) -> dict[str, object]:
    """One round: batch-1 decode rate (first token's time taken out), the long prefill, and the
    aggregate rate of ``--concurrency`` requests."""
    short = _prompt(32, 0)
    first, _ = timed([short], 1)
    total, ids = timed([short], args.decode_tokens)
    long_s, _ = timed([_prompt(args.prefill_tokens, 1)], 1)
    many = [_prompt(32, 10 + i) for i in range(args.concurrency)]
    batch_s, _ = timed(many, args.decode_tokens)
    return {
        "decode_tok_s": (args.decode_tokens - 1) / (total - first),
        "prefill_s": long_s,
        "concurrent_tok_s": args.concurrency * args.decode_tokens / batch_s,
        "ids": ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=1300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds, xhal then transformers in each; medians are printed",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="xhal without CPU 'graphs'")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint dir (made once, reused)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(args.dir or Path(tmp) / "smollm2-135m-shape")
        sides = {"xhal": xhal_side(model_dir, args), "hf": hf_side(model_dir, args)}
        for timed, _ in sides.values():
            timed([_prompt(32, 0)], 2)  # warm-up
        # alternate the two within each round, so a change in the machine's load hits both
        rounds = [
            {name: measure(timed, args) for name, (timed, _) in sides.items()}
            for _ in range(args.rounds)
        ]
        for _, close in sides.values():
            close()
    print(
        f"CPU, {args.threads} threads, SmolLM2-135M shape (random float32 weights), greedy, "
        f"median of {args.rounds} round(s)"
    )
    print(f"{'':<34}{'xhal':>12}{'transformers':>14}{'xhal / hf':>11}")
    rows = (
        ("decode, batch 1 (tok/s)", "decode_tok_s", True),
        (f"prefill {args.prefill_tokens} tokens (s)", "prefill_s", False),
        (f"{args.concurrency} concurrent, aggregate (tok/s)", "concurrent_tok_s", True),
    )
    for title, key, higher in rows:
        xs = [r["xhal"][key] for r in rounds]
        hs = [r["hf"][key] for r in rounds]
        ratios = [x / h if higher else h / x for x, h in zip(xs, hs)]
        print(
            f"{title:<34}{statistics.median(xs):>12.2f}{statistics.median(hs):>14.2f}"
            f"{statistics.median(ratios):>10.2f}x"
        )
        if args.rounds > 1:
            print(f"{'  per round, xhal / hf':<34}" + " ".join(f"{r:.2f}x" for r in ratios))
    scaling = [r["xhal"]["concurrent_tok_s"] / r["xhal"]["decode_tok_s"] for r in rounds]
    print(
        f"xhal {args.concurrency}-request aggregate / batch-1 rate: "
        f"{statistics.median(scaling):.2f}x"
    )
    same = all(r["xhal"]["ids"] == r["hf"]["ids"] for r in rounds)
    print(f"greedy ids identical (batch 1, {args.decode_tokens} tokens): {same}")


if __name__ == "__main__":
    main()
