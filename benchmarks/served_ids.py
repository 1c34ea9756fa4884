"""Greedy token ids from a running server, and two such runs compared (issue 14: TP=2 against
TP=1 on the same dummy model, which is the same model at every TP size).

    python -m benchmarks.served_ids fetch --base-url http://127.0.0.1:8000 OUT.json \
        [--prompts 16] [--prompt-len 64] [--tokens 16] [--vocab-size 800]
    python -m benchmarks.served_ids compare A.json B.json

``fetch`` sends ``--prompts`` seeded random prompts of token ids (below ``--vocab-size``), one
completion each (temperature 0, ``--tokens`` new tokens, end of sequence ignored, the ids
returned: ``return_token_ids``), and writes the ids. ``compare`` prints how many prompts have
equal ids and where the first difference of each other one is; it exits 0 either way (bf16 TP
sums in another order, so near-tied greedy choices may flip: the issue asks for "most").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def served_model(base_url: str, timeout: float = 60) -> str:
    """The name of the model the server serves (its first in ``/v1/models``)."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout) as reply:
        return json.load(reply)["data"][0]["id"]


def completion_ids(
    base_url: str, model: str, prompt: list[int], tokens: int, timeout: float = 600
) -> list[int]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.load(response)
    except urllib.error.HTTPError as e:  # the server says why: show it
        raise SystemExit(f"{e.code} from {request.full_url}: {e.read().decode()[:500]}") from None
    return list(reply["choices"][0]["token_ids"])


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[str]]:
    """How many of the prompts' id lists are equal, and a line for each one that is not."""
    if len(a) != len(b):
        raise ValueError(f"the runs have {len(a)} and {len(b)} prompts")
    equal, lines = 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            equal += 1
            continue
        first = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        lines.append(f"prompt {i}: first difference at token {first} ({x[first:first + 3]} vs "
                     f"{y[first:first + 3]}), {len(x)} and {len(y)} tokens")  # fmt: skip
    return equal, lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch")
    fetch.add_argument("out", type=Path)
    fetch.add_argument("--base-url", default="http://127.0.0.1:8000")
    fetch.add_argument("--prompts", type=int, default=16)
    fetch.add_argument("--prompt-len", type=int, default=64)
    fetch.add_argument("--tokens", type=int, default=16)
    fetch.add_argument("--vocab-size", type=int, default=800)
    fetch.add_argument("--concurrency", type=int, default=4)
    both = sub.add_parser("compare")
    both.add_argument("a", type=Path)
    both.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        batch = prompts(args.prompts, args.prompt_len, args.vocab_size)
        model = served_model(args.base_url)
        with ThreadPoolExecutor(args.concurrency) as pool:
            ids = list(
                pool.map(lambda p: completion_ids(args.base_url, model, p, args.tokens), batch)
            )
        args.out.write_text(json.dumps({"prompts": batch, "ids": ids}))
        print(f"{len(ids)} prompts, {sum(map(len, ids))} tokens -> {args.out}")
        return
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    if a["prompts"] != b["prompts"]:
        sys.exit("the runs sent different prompts")
    equal, lines = compare(a["ids"], b["ids"])
    names = f"{args.a.name} vs {args.b.name}"
    print(f"greedy ids equal for {equal} of {len(a['ids'])} prompts ({names})")
    for line in lines:
        print("  " + line)


if __name__ == "__main__":
    main()
