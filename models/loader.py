"""Loading a Hugging Face checkpoint directory (config.json + *.safetensors) into an xhal model."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from models.registry import resolve_model_class
from xhal.layers import TensorParallel

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a model directory needs a Hugging Face config.json"
        )
    return json.loads(path.read_text())


def resolve_dtype(dtype: str | torch.dtype, config: Mapping[str, Any]) -> torch.dtype:
    """``"auto"`` is the checkpoint's ``dtype`` / ``torch_dtype`` (float32 when absent)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names when there is one, else all."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index.name} names shards that are missing: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_safetensors(
    files: list[Path], progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files`` (on the CPU), with a progress bar over tensors."""
    from tqdm.auto import tqdm

    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tp: TensorParallel = TensorParallel(0, 1),
    config: Mapping[str, Any] | None = None,
    progress: bool = True,
    load_format: str = "auto",
) -> nn.Module:
    """Build the model config.json names, with its parameters in ``dtype`` on ``device``, and
    load this rank's shards of the checkpoint's weights.

    ``config`` replaces config.json when given (``xhal-align --override`` uses it).
    ``load_format="dummy"`` reads no weights: parameters are drawn at random (seeded; normal with
    std 0.02, norm weights 1), so a directory with only config.json serves for benchmarks, as
    vLLM's ``--load-format dummy`` does. Every tensor-parallel size gets the same model: a rank
    keeps its shards of the tensors a single rank would draw, so TP=2 can be checked against
    TP=1 without a checkpoint. Raises
    ``KeyError`` for an unsupported architecture (listing the supported ones) and
    ``models.weights.WeightsMismatchError`` naming any missing or unexpected tensor.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    config = dict(config) if config is not None else read_config(model_dir)
    model_cls = resolve_model_class(config)
    torch_dtype = resolve_dtype(dtype, config)
    files = safetensors_files(model_dir) if load_format == "auto" else []
    with _default_dtype(torch_dtype), torch.device(device):
        model = model_cls(config, tp)
    if load_format == "dummy" and tp.size == 1:
        randomize_weights(model)
    elif load_format == "dummy":
        with _default_dtype(torch_dtype), torch.device("meta"):
            whole = model_cls(config, TensorParallel(0, 1))
        model.load_weights(_random_tensors(whole, torch.device(device)))
    else:
        model.load_weights(iter_safetensors(files, progress))
    return model.eval()


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded random weights in place: normal(0, 0.02), norm weights 1, biases 0 (drawn on the
    parameters' device, so the same seed gives the same model on the same kind of device)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        _draw(name, param, generators[param.device])


def _draw(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """The dummy value of parameter ``name``, in place: norm weights 1, biases 0, the rest drawn
    from normal(0, 0.02) by ``generator`` (the only step that advances it)."""
    if "norm" in name:
        tensor.fill_(1.0)
    elif name.endswith("bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, 0.02, generator=generator)


@torch.no_grad()
def _random_tensors(
    whole: nn.Module, device: torch.device, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """The values ``randomize_weights`` gives the single-rank model ``whole`` (built on the meta
    device: only its parameters' names, shapes and order are read), one whole tensor at a time
    on ``device``, named as the parameters are: each rank's loader keeps its shard of them."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in whole.named_parameters():
        tensor = torch.empty(param.shape, dtype=param.dtype, device=device)
        _draw(name, tensor, generator)
        yield name, tensor
