"""Write a model directory for ``--load-format dummy`` serving benchmarks: a Llama-3-shaped
config.json (``SHAPE``: llama3-8b, the default, or llama3.2-1b) plus the built-in model's tokenizer
(its ids all fall inside the Llama-3 vocabulary).

    python -m benchmarks.make_dummy_model DIR [SHAPE]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.bench_model import SHAPES
from serve_cli.default_model import ensure_default_model


def main() -> None:
    shape = sys.argv[2] if len(sys.argv) > 2 else "llama3-8b"
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
    out = Path(sys.argv[1] if len(sys.argv) > 1 else f"dummy-{shape}")
    out.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[shape], "model_type": "llama", "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source = ensure_default_model()
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(path, out / path.name)
    print(out)


if __name__ == "__main__":
    main()
