"""A GGUF file as a Hugging Face safetensors checkpoint directory, converted once into the cache.

transformers reads GGUF files (through the ``gguf`` package, with ``accelerate``) and dequantizes
them; we take its model and tokenizer and write the directory ourselves:

- weights in float32: a dequantized GGUF weight is ``scale * q + min`` with a float16 scale, which
  needs more significant bits than bfloat16's 8, so float32 is the one dtype that stores exactly
  what transformers computes from the file (xhal then equals transformers on it token for token);
  ``--dtype bfloat16`` still serves it in half the memory;
- tied embeddings stored once (safetensors refuses shared tensors, and the checkpoint says
  ``tie_word_embeddings``);
- a ``config.json`` without the GGUF ``quantization_config`` (the weights are plain floats now)
  and with both rope spellings, and a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``
  with the chat template inline, which every transformers release pyproject allows loads
  (transformers 5 writes ``TokenizersBackend`` and a separate ``chat_template.jinja``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

CONVERTER_VERSION = 1  # bump when the written files change, so stale conversions are not reused
# import name -> pip name of what the conversion needs beyond xhal[serve]'s core
REQUIRED = {"gguf": "gguf", "accelerate": "accelerate", "transformers": "transformers"}
DROPPED_CONFIG_KEYS = ("quantization_config", "_model_name_or_path", "_name_or_path")
DROPPED_TOKENIZER_KEYS = ("backend", "is_local", "local_files_only", "name_or_path")


def cache_name(gguf_path: Path) -> str:
    """The cache directory's name: the file's stem plus a digest of where it is, its size and
    its modification time (a file replaced in place converts again)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return f"gguf-{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_converted(
    gguf_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    announce: bool = True,
) -> Path:
    """The checkpoint directory converted from ``gguf_path`` (``cache_dir / cache_name(...)``),
    converting it on first use. Raises ``RuntimeError`` naming the packages to install."""
    from serve_cli.model_cache import cache_root, ensure_cached

    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    name = cache_name(path)
    final = cache_root(cache_dir) / name
    if not final.is_dir():
        require_packages()
        if announce:
            print(
                f"xhal-serve: converting {path.name} to a safetensors checkpoint in {final} "
                "(once; about half a minute)",
                flush=True,
            )
    return ensure_cached(name, lambda out: convert(path, out), cache_dir)


def require_packages() -> None:
    missing = [pip for mod, pip in REQUIRED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError(
            f"reading a GGUF file needs {', '.join(missing)}; install with:  "
            f"pip install 'xhal[serve]'  (or: pip install {' '.join(missing)})"
        )


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write ``gguf_path`` as config.json, model.safetensors, generation_config.json and
    tokenizer files into the existing directory ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = checkpoint_config(model.config.to_dict(), type(model).__name__)
    write_weights(model.state_dict(), bool(config.get("tie_word_embeddings")), out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out_dir))
    write_tokenizer(tokenizer, config, out_dir)


def checkpoint_config(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """transformers' config of the dequantized model as a plain float32 checkpoint's."""
    config = {k: v for k, v in config.items() if k not in DROPPED_CONFIG_KEYS}
    if not config.get("architectures"):  # None in the config transformers builds from GGUF
        config["architectures"] = [architecture]
    config["dtype"] = config["torch_dtype"] = "float32"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # transformers 4 reads it at the top level
        config.setdefault("rope_theta", rope["rope_theta"])
    return config


def write_weights(state_dict: dict[str, Any], tied: bool, out_dir: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in state_dict.items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def write_tokenizer(tokenizer: Any, config: dict[str, Any], out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = {
        k: v for k, v in json.loads(config_path.read_text()).items()
        if k not in DROPPED_TOKENIZER_KEYS
    }
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if config.get("max_position_embeddings"):
        tokenizer_config["model_max_length"] = int(config["max_position_embeddings"])
    template_file = out_dir / "chat_template.jinja"
    if template_file.is_file():
        tokenizer_config["chat_template"] = template_file.read_text()
        template_file.unlink()
    elif tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
