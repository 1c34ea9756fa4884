"""Reading a Hugging Face model config, given as a ``PretrainedConfig`` or a plain dict of
config.json (older and newer transformers spellings alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_NO_DEFAULT = object()


def get(config: Any, name: str, default: Any = _NO_DEFAULT) -> Any:
    """``config.name`` or ``config[name]``; a missing required field raises naming it."""
    value = (
        config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    )
    if value is _NO_DEFAULT:
        raise ValueError(f"model config has no {name!r}")
    return value


def head_dim(config: Any) -> int:
    return get(config, "head_dim", None) or get(config, "hidden_size") // get(
        config, "num_attention_heads"
    )


def num_kv_heads(config: Any) -> int:
    return get(config, "num_key_value_heads", None) or get(config, "num_attention_heads")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope dict normalized as transformers' ``standardize_rope_params`` does: ``rope_type``,
    ``rope_theta``, optional ``partial_rotary_factor`` and, for scaled types,
    ``original_max_position_embeddings``."""
    params = dict(get(config, "rope_parameters", None) or get(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", get(config, "rope_theta", None) or 10000.0)
    partial = get(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = get(config, "original_max_position_embeddings", None)
        if original is not None:  # a top-level value wins, as in transformers (Phi-3)
            params["original_max_position_embeddings"] = original
        params.setdefault(
            "original_max_position_embeddings", get(config, "max_position_embeddings")
        )
    return params


def sliding_window(config: Any, layer_id: int) -> int | None:
    """Layer ``layer_id``'s attention window, or None for full attention.

    ``layer_types`` decides when present (transformers 5); otherwise Qwen2-style
    ``use_sliding_window`` / ``max_window_layers``; otherwise ``sliding_window`` (Mistral).
    """
    window = get(config, "sliding_window", None)
    layer_types = get(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_id] == "sliding_attention" else None
    use = get(config, "use_sliding_window", None)
    if use is None:
        return window
    return window if use and layer_id >= get(config, "max_window_layers", 0) else None
