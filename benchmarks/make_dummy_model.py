"""Write a model directory for ``--load-format dummy`` serving benchmarks: a Llama-3-8B-shaped
config.json (``--moe``: the Qwen3-30B-A3B-shaped mixture of experts of ``bench_moe``) plus the
built-in model's tokenizer (its ids all fall inside either vocabulary).

    python -m benchmarks.make_dummy_model DIR [--moe]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.bench_model import CONFIG
from benchmarks.bench_moe import CONFIG as MOE_CONFIG
from serve_cli.default_model import ensure_default_model


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--moe"]
    moe = "--moe" in sys.argv[1:]
    out = Path(args[0] if args else ("dummy-qwen3-30b-a3b" if moe else "dummy-llama3-8b"))
    out.mkdir(parents=True, exist_ok=True)
    config = {**MOE_CONFIG, "dtype": "bfloat16"} if moe else {**CONFIG, "model_type": "llama", "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source = ensure_default_model()
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(path, out / path.name)
    print(out)


if __name__ == "__main__":
    main()
