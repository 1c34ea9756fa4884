"""The sparse mixture-of-experts block MoE decoders share: a replicated router, the routed experts
as one ``FusedMoE`` layer, and optionally a shared expert scaled by a sigmoid gate (Qwen2-MoE).

Checkpoints store each expert's matrices as their own tensors (``experts.{e}.gate_proj.weight``
or Mixtral's ``experts.{e}.w1.weight``); ``expert_stacking`` tells the weight loader how they
stack into the layer's two per-layer tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from models import config as cfg
from models.weights import StackedExperts
from xhal.interfaces.forward_context import get_forward_context
from xhal.layers import (
    FusedMoE,
    MergedColumnParallelLinear,
    MoeRouter,
    ReplicatedLinear,
    RowParallelLinear,
    SiluAndMul,
    TensorParallel,
)

if TYPE_CHECKING:
    from xhal.layers import RMSNorm


@dataclass(frozen=True)
class MoeOptions:
    intermediate_size: int  # each expert's
    renormalize: bool  # divide the top-k probabilities by their sum
    shared_expert_intermediate_size: int = 0  # 0: no shared expert


def num_experts(config: Any) -> int:
    # Qwen's hub configs say num_experts; transformers 5 writes num_local_experts (Mixtral's name)
    return cfg.get(config, "num_experts", None) or cfg.get(config, "num_local_experts")


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    """Whether layer ``layer_id`` is a mixture of experts (Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step`` pick dense layers; absent, every layer is sparse)."""
    dense = cfg.get(config, "mlp_only_layers", None) or []
    step = cfg.get(config, "decoder_sparse_step", None) or 1
    return layer_id not in dense and num_experts(config) > 0 and (layer_id + 1) % step == 0


def expert_stacking(
    num_experts: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    block: str = ".mlp",
) -> tuple[StackedExperts, ...]:
    """Where each expert's checkpoint tensors (``{block}.experts.{e}.{name}.weight``, names in
    gate, up, down order) go in the stacked weights of ``.mlp.experts``."""
    gate, up, down = (f"{block}.experts.{{e}}.{name}.weight" for name in names)
    return (
        StackedExperts(".mlp.experts.w13_weight", gate, "w1", num_experts),
        StackedExperts(".mlp.experts.w13_weight", up, "w3", num_experts),
        StackedExperts(".mlp.experts.w2_weight", down, "w2", num_experts),
    )


class SharedExpert(nn.Module):
    """A dense gated MLP whose output stays this rank's partial sum (reduced with the experts')."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], tp=tp
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, reduce_results=False, tp=tp
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """``gate`` (router, ``[E, H]``), ``experts`` and optional ``shared_expert`` /
    ``shared_expert_gate``, with one all-reduce of their summed partial outputs."""

    def __init__(self, config: Any, options: MoeOptions, tp: TensorParallel) -> None:
        super().__init__()
        hidden_size, self.tp = cfg.get(config, "hidden_size"), tp
        act = cfg.get(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(
                f"hidden_act {act!r} is not supported by the MoE layer; supported: 'silu'"
            )
        experts, top_k = num_experts(config), cfg.get(config, "num_experts_per_tok")
        self.gate = MoeRouter(hidden_size, experts, top_k, options.renormalize)
        self.experts = FusedMoE(
            num_experts=experts,
            top_k=top_k,
            hidden_size=hidden_size,
            intermediate_size=options.intermediate_size,
            renormalize=options.renormalize,
            reduce_results=False,
            tp=tp,
        )
        if options.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(
                hidden_size, options.shared_expert_intermediate_size, tp
            )
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden)  # [T, E]
        return self._finish(hidden, self.experts(hidden, router_logits))

    def forward_normed(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(hidden, residual)[0]), hidden + residual)`` with the residual add, the
        norm, the router and its top-k as one op (``MoeRouter``'s fused path)."""
        routing = self.gate(hidden, residual, norm)
        out = self.experts.forward_routed(routing.hidden, routing.topk_weights, routing.topk_ids)
        return self._finish(routing.hidden, out), routing.residual

    def forward_projected(
        self, attn_out: torch.Tensor, o_weight: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_normed(attn_out @ o_weight.T, residual, norm)`` with the attention's o
        projection in the router's op too (one rank, no o bias: the decoder layer checks)."""
        routing = self.gate(attn_out, residual, norm, o_weight)
        out = self.experts.forward_routed(routing.hidden, routing.topk_weights, routing.topk_ids)
        return self._finish(routing.hidden, out), routing.residual

    def _finish(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The shared expert (if any) added to the experts' partial sum ``out``, then reduced."""
        if self.shared_expert is not None:
            # the sigmoid gate is computed in full on every rank, so scaling the partial sum
            # before the one reduction is exact
            gate = torch.sigmoid(self.shared_expert_gate(hidden))  # [T, 1]
            out = out + gate * self.shared_expert(hidden)
        if self.tp.size > 1:
            out = get_forward_context().collective.all_reduce(out)
        return out
