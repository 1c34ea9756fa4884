"""The one place tests name the model a fast server test serves: the built-in tiny random Llama
(``builtin:tiny-random``; with no model ``xhal-serve`` serves SmolLM2, which takes longer). Tests
call these helpers rather than spelling the arguments out, so pointing every fast server test at
another model is an edit here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_MODEL_NAME = "xhal-tiny-random"  # the name the server answers to


def tiny_server_args(*extra: str) -> list[str]:
    """``xhal-serve`` arguments that serve the tiny model, then ``extra``."""
    return ["--model", "builtin:tiny-random", *extra]


def tiny_model_dir() -> Path:
    """The tiny model's checkpoint directory (generated once into the cache)."""
    from serve_cli.default_model import ensure_default_model

    return ensure_default_model()


def tiny_tokenizer() -> Any:
    """The tiny model's tokenizer, built the way the server's copy was (an independent reference
    for what the server tokenizes)."""
    from serve_cli.default_model import build_tokenizer

    return build_tokenizer()
