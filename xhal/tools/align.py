"""``xhal-align``: run a checkpoint on xhal and on transformers with the same prompt and print,
layer by layer, how far the hidden states are apart, then the logits.

The xhal side prefills one sequence through an eager ``ModelExecutor`` over fresh paged caches.
Hidden states are captured by forward hooks on both sides at the same points: the embeddings, each
mixture-of-experts layer's router logits (``mlp.gate``, before the layer's output), each decoder
layer's output (the residual stream after it) and the final norm.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from xhal import platforms
from xhal.executor import ExecutorConfig, ModelExecutor
from xhal.interfaces.metadata import AttentionMetadata, BatchKind

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}


# The xhal side: one prefill sequence through the executor -------------------------------------


def prefill_metadata(
    num_tokens: int, block_size: int = 16, device: str | torch.device = "cpu"
) -> AttentionMetadata:
    """Metadata of a single sequence prefilled from an empty cache into blocks 0, 1, 2, ..."""

    def i32(values: Sequence[int] | torch.Tensor, on: str | torch.device = device) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(on)

    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata.from_host_lengths(
        BatchKind.PREFILL,
        i32([num_tokens], "cpu"),
        i32([num_tokens], "cpu"),
        i32(torch.arange(num_blocks)).view(1, num_blocks),
        i32(torch.arange(num_tokens)),
    )


@torch.no_grad()
def xhal_prefill(
    model: nn.Module, input_ids: torch.Tensor, platform: str | None = None, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [T, hidden], float32 logits [T, vocab])`` of one prompt, prefilled from scratch by
    a ``ModelExecutor`` (eager) over fresh paged caches."""
    param = next(model.parameters())
    num_tokens = input_ids.numel()
    config = ExecutorConfig(
        dtype=param.dtype, block_size=block_size, max_model_len=num_tokens, enforce_eager=True
    )
    executor = ModelExecutor(model, platforms.get(platform or param.device.type), config)
    executor.bind_kv_caches(executor.allocate_kv_caches(num_blocks=-(-num_tokens // block_size)))
    input_ids = input_ids.to(device=param.device, dtype=torch.int32)
    positions = torch.arange(num_tokens, dtype=torch.int32, device=param.device)
    hidden = executor.execute(
        input_ids, positions, prefill_metadata(num_tokens, block_size, param.device)
    )
    return hidden, executor.compute_logits(hidden)


# Hooks and comparison --------------------------------------------------------------------------


def _xhal_layer_output(out: Any) -> torch.Tensor:
    hidden, residual = out  # xhal decoder layers pass the residual along (vLLM style)
    return hidden + residual


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@contextlib.contextmanager
def capture_hidden_states(model: nn.Module, xhal_side: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Record the hidden states at each comparison point of a Hugging Face-layout causal LM."""
    inner = model.model
    layer_output: Callable[[Any], torch.Tensor] = _xhal_layer_output if xhal_side else _first
    points: list[tuple[str, nn.Module, Callable[[Any], torch.Tensor]]] = [
        ("embed", inner.embed_tokens, _first)
    ]
    for i, layer in enumerate(inner.layers):
        router = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(router, nn.Module):  # a mixture of experts: its router logits [T, E]
            points.append((f"router {i}", router, _first))
        points.append((f"layer {i}", layer, layer_output))
    points.append(("norm", inner.norm, _first))
    states: dict[str, torch.Tensor] = {}

    def hook(name: str, reduce: Callable[[Any], torch.Tensor]):
        def record(module: nn.Module, args: Any, out: Any) -> None:
            h = reduce(out).detach().float()
            states[name] = h.reshape(-1, h.shape[-1]).cpu()  # [T, hidden] (drops HF's batch dim)

        return record

    handles = [module.register_forward_hook(hook(n, r)) for n, module, r in points]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class Row:
    point: str
    max_abs: float
    max_rel: float  # max |xhal - ref| / max |ref|


def compare(
    ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], order: Sequence[str]
) -> list[Row]:
    rows = []
    for point in order:
        a, b = ours[point].float(), ref[point].float()
        if a.shape != b.shape:
            raise ValueError(
                f"{point}: xhal shape {tuple(a.shape)} != transformers {tuple(b.shape)}"
            )
        max_abs = float((a - b).abs().max()) if a.numel() else 0.0
        scale = float(b.abs().max()) if b.numel() else 0.0
        rows.append(Row(point, max_abs, max_abs / scale if scale > 0 else max_abs))
    return rows


def format_table(rows: Sequence[Row], tol: float) -> str:
    lines = [f"{'point':<12} {'max_abs':>11} {'max_rel':>11}", "-" * 36]
    for r in rows:
        flag = "  <-- diverges" if r.max_rel > tol else ""
        lines.append(f"{r.point:<12} {r.max_abs:>11.3e} {r.max_rel:>11.3e}{flag}")
    first = next((r for r in rows if r.max_rel > tol), None)
    if first is None:
        lines.append(f"all points agree within max_rel {tol:.0e}")
    else:
        lines.append(f"first divergence: {first.point} (max_rel {first.max_rel:.3e} > {tol:.0e})")
    return "\n".join(lines)


# Both sides ------------------------------------------------------------------------------------


def align(
    model_dir: str,
    input_ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    config: dict[str, Any] | None = None,
) -> list[Row]:
    """Rows for every comparison point and the logits; ``config`` replaces the xhal side's
    config.json (to test a hypothesis about a config field)."""
    from transformers import AutoModelForCausalLM

    from models import load_model

    model = load_model(model_dir, dtype=dtype, device=device, config=config, progress=False)
    with capture_hidden_states(model, xhal_side=True) as ours:
        _, logits = xhal_prefill(model, input_ids)
    ours["logits"] = logits.cpu()

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    hf = hf.to(device).eval()
    ids = input_ids.to(device=device, dtype=torch.long).view(1, -1)
    with torch.no_grad(), capture_hidden_states(hf, xhal_side=False) as ref:
        ref_logits = hf(input_ids=ids, use_cache=False).logits
    ref["logits"] = ref_logits[0].float().cpu()
    missing = sorted(set(ours) ^ set(ref))
    if missing:
        raise ValueError(f"comparison points found on one side only: {missing}")
    return compare(ours, ref, list(ours))  # in forward order: each layer's router before it


def apply_override(config: dict[str, Any], assignment: str) -> None:
    """``"a.b=VALUE"`` sets ``config["a"]["b"]``; VALUE is JSON, else a plain string."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"expected KEY=VALUE, got {assignment!r}", param_hint="--override")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
        if not isinstance(node.get(p), dict):
            raise click.BadParameter(
                f"config has no dict at {p!r} (in {key!r})", param_hint="--override"
            )
        node = node[p]
    node[leaf] = value


def _prompt_ids(
    model_dir: str,
    prompt: str | None,
    token_ids: str | None,
    num_tokens: int,
    seed: int,
    vocab_size: int,
) -> torch.Tensor:
    if token_ids:
        ids = torch.tensor([int(t) for t in token_ids.split(",")], dtype=torch.int32)
    elif prompt is not None:
        if not any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES):
            raise click.UsageError(f"--prompt needs a tokenizer in {model_dir}; use --token-ids")
        from transformers import AutoTokenizer

        encoded = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
        ids = torch.tensor(encoded, dtype=torch.int32)
    else:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator, dtype=torch.int32)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise click.UsageError(
            f"the prompt must be 1+ token ids in [0, {vocab_size}), got {ids.tolist()}"
        )
    return ids


def run(
    model_dir: str,
    prompt: str | None,
    token_ids: str | None,
    num_tokens: int,
    seed: int,
    dtype: str,
    device: str,
    tol: float | None,
    override: tuple[str, ...],
) -> None:
    """``xhal-align``'s work (its command line is ``xhal.tools.align_cli``): print the table; exit 1
    on a divergence."""
    from models.loader import read_config, resolve_dtype

    config = read_config(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    input_ids = _prompt_ids(model_dir, prompt, token_ids, num_tokens, seed, config["vocab_size"])
    xhal_config = json.loads(json.dumps(config))  # a deep copy for the overrides
    for assignment in override:
        apply_override(xhal_config, assignment)
    tol = tol if tol is not None else DEFAULT_TOLERANCE.get(torch_dtype, 1e-2)
    rows = align(model_dir, input_ids, torch_dtype, device, xhal_config)
    click.echo(f"{model_dir}: {input_ids.numel()} prompt tokens, {torch_dtype}, {device}")
    if override:
        click.echo(f"xhal config overrides: {', '.join(override)}")
    click.echo(format_table(rows, tol))
    if any(r.max_rel > tol for r in rows):
        raise SystemExit(1)
