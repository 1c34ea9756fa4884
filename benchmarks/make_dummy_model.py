"""Write a model directory for ``--load-format dummy`` serving benchmarks: a Llama-3-8B-shaped
config.json plus the built-in model's tokenizer (its ids all fall inside the 8B vocabulary).

    python -m benchmarks.make_dummy_model DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.bench_model import CONFIG
from serve_cli.default_model import ensure_default_model


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dummy-llama3-8b")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**CONFIG, "model_type": "llama", "dtype": "bfloat16"}, indent=2))
    source = ensure_default_model()
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(path, out / path.name)
    print(out)


if __name__ == "__main__":
    main()
