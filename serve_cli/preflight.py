"""Checks ``xhal-serve`` makes before it starts the engine process, so that a mistake a user can
fix is reported at once, in one line, before any weight is read: a busy port, a missing or
broken ``config.json``, missing tokenizer files, a ``--max-model-len`` past the model's positions,
safetensors files that are not safetensors, a model architecture xhal has no class for, and (a
warning) a KV cache too small for one sequence of ``max_model_len`` tokens.

Everything here but ``check_architecture`` reads only small files and imports no torch, so those
checks answer in a fraction of a second; ``check_architecture`` imports the model registry.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_cli.engine.config import EngineConfig

_MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header is JSON; more than this is not one
# Tokenizer files transformers can build a tokenizer from, each a complete set.
_TOKENIZER_SETS = (
    ("tokenizer.json",),
    ("tokenizer.model",),  # sentencepiece
    ("vocab.json", "merges.txt"),  # byte-level BPE
    ("vocab.txt",),  # WordPiece
)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# bytes per element of the safetensors dtypes (others are not size-checked)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
             "F8_E5M2": 1}  # fmt: skip


class PreflightError(RuntimeError):
    """A start-up check failed; the message is the one line to show the user."""


def check_port(host: str, port: int) -> None:
    """The address uvicorn will bind later is free now (port 0, any free port, always is)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            reason = (e.strerror or str(e)).lower()
            raise PreflightError(
                f"cannot listen on {host}:{port}: {reason}; stop the process using it or choose "
                "another --port"
            ) from None


def read_model_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise PreflightError(
            f"{model_dir} has no config.json: --model needs a Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise PreflightError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreflightError(f"{path} is not valid JSON ({e}); restore it from the model") from None
    if not isinstance(config, dict):
        raise PreflightError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config


def check_tokenizer_files(model_dir: Path) -> None:
    present = {p.name for p in model_dir.iterdir()} if model_dir.is_dir() else set()
    if any(all(name in present for name in names) for names in _TOKENIZER_SETS):
        return
    partial = [names for names in _TOKENIZER_SETS if any(n in present for n in names)]
    if partial:
        missing = [n for n in partial[0] if n not in present]
        raise PreflightError(
            f"{model_dir} has {', '.join(n for n in partial[0] if n in present)} but not "
            f"{', '.join(missing)}; copy the tokenizer files from the model's repository"
        )
    raise PreflightError(
        f"{model_dir} has no tokenizer: expected tokenizer.json (or tokenizer.model, or "
        "vocab.json with merges.txt); copy the tokenizer files from the model's repository"
    )


def model_max_len(config: dict[str, Any], engine: EngineConfig) -> int:
    """The ``max_model_len`` the engine will use; past the model's positions is an error."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    limit = text.get("max_position_embeddings")
    wanted = engine.max_model_len or limit or 2048
    if limit is not None and wanted > limit:
        raise PreflightError(
            f"--max-model-len {wanted} exceeds the model's max_position_embeddings ({limit}); "
            f"give --max-model-len {limit} or less"
        )
    return int(wanted)


def check_safetensors(model_dir: Path) -> None:
    """Each weight file has a well-formed header and is as long as the header says (a cut-off
    download fails here, by name, instead of deep inside loading)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PreflightError(f"{index} is not a valid safetensors index ({e})") from None
        files = [model_dir / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PreflightError(f"{index.name} names shards that are missing: {', '.join(absent)}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise PreflightError(
            f"{model_dir} has no *.safetensors weights (xhal loads safetensors checkpoints; "
            "--load-format dummy serves random weights instead)"
        )
    for path in files:
        problem = _safetensors_problem(path)
        if problem:
            raise PreflightError(
                f"{path} is not a valid safetensors file ({problem}); download it again"
            )


def _safetensors_problem(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, too short for a header"
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_HEADER_BYTES):
                return f"its header claims {length} bytes of a {size}-byte file"
            header = json.loads(f.read(length))
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = []
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = tensor["data_offsets"]
            shape = [int(d) for d in tensor["shape"]]
        except (KeyError, TypeError, ValueError):
            return f"the entry of tensor {name!r} lacks a shape or data offsets"
        itemsize = _ITEMSIZE.get(tensor.get("dtype"))
        if itemsize is not None and end - start != math.prod(shape) * itemsize:
            return (
                f"tensor {name!r} ({tensor['dtype']} {shape}) spans {end - start} bytes, not "
                f"{math.prod(shape) * itemsize}"
            )
        ends.append(end)
    if ends and 8 + length + max(ends) > size:
        return f"truncated: the tensors need {8 + length + max(ends)} bytes, the file has {size}"
    return None


def check_architecture(config: dict[str, Any]) -> None:
    from models.registry import supported_architectures

    supported = supported_architectures()
    named = config.get("architectures") or []
    if not any(arch in supported for arch in named):
        what = ", ".join(map(str, named)) if named else "no architecture (no 'architectures' field)"
        raise PreflightError(
            f"config.json names {what}, which xhal has no model for; supported: "
            f"{', '.join(supported)}"
        )


def kv_budget_warning(
    config: dict[str, Any], engine: EngineConfig, max_model_len: int
) -> str | None:
    """A warning when the KV cache the user sized holds less than one ``max_model_len``
    sequence (requests that need more are refused); None when it does, or is sized later."""
    if engine.num_kv_blocks is not None:
        num_blocks = engine.num_kv_blocks
    elif engine.kv_cache_memory is not None:
        per_block = _bytes_per_block(config, engine)
        if per_block is None:
            return None
        num_blocks = engine.kv_cache_memory // per_block
    else:
        return None
    return small_kv_warning(num_blocks, engine.block_size, max_model_len)


def small_kv_warning(num_blocks: int, block_size: int, max_model_len: int) -> str | None:
    tokens = num_blocks * block_size
    if tokens >= max_model_len:
        return None
    return (
        f"the KV cache holds {tokens} tokens ({num_blocks} blocks of {block_size}), less than one "
        f"sequence of max_model_len {max_model_len} tokens: longer requests will be refused; "
        "raise --num-kv-blocks / --kv-cache-memory or lower --max-model-len"
    )


def _bytes_per_block(config: dict[str, Any], engine: EngineConfig) -> int | None:
    """K and V of one block over every layer, per tensor-parallel rank."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    dtype = engine.dtype
    if dtype == "auto":
        dtype = str(text.get("dtype") or text.get("torch_dtype") or "float32")
    elem = _DTYPE_BYTES.get(dtype.removeprefix("torch."))
    if elem is None:
        return None
    kv_heads_per_rank = max(1, kv_heads // engine.tensor_parallel_size)
    return 2 * layers * kv_heads_per_rank * head_dim * engine.block_size * elem


def run_checks(
    host: str,
    port: int,
    model_dir: Path,
    engine: EngineConfig,
    warn: Callable[[str], None],
    before_imports: Callable[[], None] | None = None,
) -> None:
    """Every check, cheapest first; raises ``PreflightError`` at the first failure and passes
    warnings to ``warn``. ``before_imports`` runs between the file checks and those that import
    torch (the caller's own slower checks)."""
    check_port(host, port)
    config = read_model_config(model_dir)
    check_tokenizer_files(model_dir)
    max_model_len = model_max_len(config, engine)
    warning = kv_budget_warning(config, engine, max_model_len)
    if warning:
        warn(warning)
    if engine.load_format != "dummy":
        check_safetensors(model_dir)
    if before_imports is not None:
        before_imports()
    check_architecture(config)
