"""A mixture of experts' router: the replicated ``[E, H]`` projection whose logits pick each
token's experts, fused with the norm before it on the decode path."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from xhal import ops
from xhal.layers.linear import ReplicatedLinear

if TYPE_CHECKING:
    from xhal.layers.norm import RMSNorm


class Routing(NamedTuple):
    """What the fused router returns; the logits come first, so a forward hook that takes the
    first output (``xhal-align``'s router point) sees the logits either way."""

    router_logits: torch.Tensor  # [T, E] in the hidden dtype
    hidden: torch.Tensor  # [T, H]: the normed hidden states the experts take
    residual: torch.Tensor  # [T, H]: x + residual, the residual stream after attention
    topk_weights: torch.Tensor  # float32 [T, k]
    topk_ids: torch.Tensor  # int32 [T, k]


class MoeRouter(ReplicatedLinear):
    """``gate`` of a sparse block (no bias, as in every MoE checkpoint we load).

    ``forward(x)`` returns the router logits ``[T, E]`` (a Hugging Face ``gate``); ``forward(x,
    residual, norm)`` runs the residual add, ``norm`` and the routing with it as one op
    (``DeviceOps.add_rms_norm_moe_route``) and returns a ``Routing``; given ``o_weight`` too,
    ``x`` is the attention's output before its o projection, which runs in the same op
    (``DeviceOps.linear_add_rms_norm_moe_route``).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__(hidden_size, num_experts)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
        o_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | Routing:
        if residual is None:
            return super().forward(x)
        if norm is None:
            raise ValueError("MoeRouter(x, residual, norm): the fused path needs the norm module")
        route = (norm.weight, norm.eps, self.weight, self.top_k, self.renormalize)
        if o_weight is None:
            return Routing(*ops.add_rms_norm_moe_route(x, residual, *route))
        return Routing(*ops.linear_add_rms_norm_moe_route(x, o_weight, residual, *route))
