"""Model classes by the ``architectures`` field of config.json, imported lazily."""

from __future__ import annotations

from typing import Any

from torch import nn

from models import config as cfg
from xhal.platforms.registry import Registry, lazy

_models: Registry[Any] = Registry("model architecture")
for _arch, _target in {
    "LlamaForCausalLM": "models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "models.llama:MistralForCausalLM",
    "MixtralForCausalLM": "models.mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "models.qwen3_moe:Qwen3MoeForCausalLM",
}.items():
    _models.register(_arch, lazy(_target))


def register_model(architecture: str, model_cls: type[nn.Module] | str, *, replace: bool = False):
    """Register a model class (or a lazy ``"module:Class"`` target) for ``architecture``."""
    loader = lazy(model_cls) if isinstance(model_cls, str) else (lambda: model_cls)
    _models.register(architecture, loader, replace=replace)
    return model_cls


def supported_architectures() -> list[str]:
    return _models.names()


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for ``architecture``; ``KeyError`` listing the supported ones if unknown."""
    if architecture not in _models:
        raise KeyError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return _models.get(architecture)()


def resolve_model_class(config: Any) -> type[nn.Module]:
    """The class for the first supported entry of ``config.architectures``."""
    architectures = cfg.get(config, "architectures", None) or []
    for arch in architectures:
        if arch in _models:
            return get_model_class(arch)
    raise KeyError(
        f"unsupported model architecture {architectures or '(config has no architectures)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
