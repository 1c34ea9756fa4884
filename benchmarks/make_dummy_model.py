"""Write a model directory for ``--load-format dummy`` serving benchmarks: a Llama-3-shaped
config.json (``SHAPE``: llama3-8b, the default, or llama3.2-1b; ``--moe``: the Qwen3-30B-A3B-shaped
mixture of experts of ``bench_moe``) plus the built-in model's tokenizer (its ids all fall inside
either vocabulary).

    python -m benchmarks.make_dummy_model DIR [SHAPE | --moe]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.bench_model import SHAPES
from benchmarks.bench_moe import CONFIG as MOE_CONFIG
from serve_cli.default_model import ensure_default_model


def main() -> None:
    moe = "--moe" in sys.argv[1:]
    args = [a for a in sys.argv[1:] if a != "--moe"]
    shape = "qwen3-30b-a3b" if moe else (args[1] if len(args) > 1 else "llama3-8b")
    if not moe and shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))} or --moe")
    out = Path(args[0] if args else f"dummy-{shape}")
    out.mkdir(parents=True, exist_ok=True)
    if moe:
        config = {**MOE_CONFIG, "dtype": "bfloat16"}
    else:
        config = {**SHAPES[shape], "model_type": "llama", "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source = ensure_default_model()
    for path in source.iterdir():
        if path.name.startswith(
            ("tokenizer", "special_tokens", "chat_template", "generation_config")
        ):
            shutil.copy(path, out / path.name)
    print(out)


if __name__ == "__main__":
    main()
