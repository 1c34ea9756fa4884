"""Mapping checkpoint tensor names onto a model's (fused, sharded) parameters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from xhal.layers import default_weight_loader


@dataclass(frozen=True)
class Stacked:
    """Checkpoint tensors named ``*{source}*`` load into ``*{target}*`` as shard ``shard_id``."""

    target: str  # e.g. ".qkv_proj"
    source: str  # e.g. ".q_proj"
    shard_id: object

    def sources(self, param_name: str) -> list[tuple[str, object]]:
        if self.target not in param_name:
            return []
        return [(param_name.replace(self.target, self.source), self.shard_id)]


@dataclass(frozen=True)
class StackedExperts:
    """Each expert's checkpoint tensor ``*{source}`` (``{e}`` the expert's index) loads into the
    stacked parameter ``*{target}`` as shard ``(e, part)``: one tensor per expert becomes one
    ``[E, ...]`` parameter."""

    target: str  # e.g. ".mlp.experts.w13_weight"
    source: str  # e.g. ".mlp.experts.{e}.gate_proj.weight"
    part: str  # the FusedMoE part: w1 (gate), w3 (up) or w2 (down)
    num_experts: int

    def sources(self, param_name: str) -> list[tuple[str, object]]:
        if not param_name.endswith(self.target):
            return []
        prefix = param_name[: -len(self.target)]
        return [
            (prefix + self.source.format(e=e), (e, self.part)) for e in range(self.num_experts)
        ]


LLAMA_STACKED = (
    Stacked(".qkv_proj", ".q_proj", "q"),
    Stacked(".qkv_proj", ".k_proj", "k"),
    Stacked(".qkv_proj", ".v_proj", "v"),
    Stacked(".gate_up_proj", ".gate_proj", 0),
    Stacked(".gate_up_proj", ".up_proj", 1),
)


class WeightsMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    module_name, _, _ = param_name.rpartition(".")
    return model.get_submodule(module_name)


def _expected_sources(
    param_name: str, stacked: Sequence[Stacked | StackedExperts]
) -> list[tuple[str, object]]:
    """The checkpoint names (with shard ids) that together fill ``param_name``."""
    parts = [source for s in stacked for source in s.sources(param_name)]
    return parts or [(param_name, None)]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[Stacked | StackedExperts] = LLAMA_STACKED,
    skip: Sequence[str] = (),
) -> None:
    """Load ``weights`` (full checkpoint tensors, Hugging Face names) into ``model``.

    A name containing a ``skip`` substring is ignored. Each tensor goes through its owning
    module's ``weight_loader`` (which keeps this rank's shard) or is copied whole. Raises
    ``WeightsMismatchError`` naming every missing and unexpected tensor.
    """
    params = dict(model.named_parameters())
    # every checkpoint name the model needs -> (parameter name, shard id)
    needed: dict[str, tuple[str, object]] = {
        source: (name, shard)
        for name in params
        for source, shard in _expected_sources(name, stacked)
    }
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        if name in needed:
            param_name, shard_id = needed[name]
            names = [name]
        elif name in params:  # an already fused tensor (e.g. a checkpoint with qkv_proj)
            param_name, shard_id = name, None
            names = [src for src, _ in _expected_sources(name, stacked)]
        else:
            unexpected.append(name)
            continue
        param = params[param_name]
        loader = getattr(_owner(model, param_name), "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise WeightsMismatchError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.update(names)
    missing = sorted(set(needed) - loaded)
    if missing or unexpected:
        raise WeightsMismatchError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing {_listing(missing)}; unexpected {_listing(sorted(unexpected))}"
        )


def _listing(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return f"{len(names)} tensor(s): {shown}" + (
        f" ... and {len(names) - limit} more" if len(names) > limit else ""
    )
