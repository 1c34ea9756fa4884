"""The mixture-of-experts layer: softmax top-k routing and the routed experts' gated MLPs, every
expert's weights stacked in two tensors so that a device runs them as grouped GEMMs."""

from __future__ import annotations

import torch
from torch import nn

from xhal import ops
from xhal.interfaces.forward_context import get_forward_context
from xhal.layers.parallel import TensorParallel
from xhal.layers.weights import check_shape, copy_shard

# checkpoint part -> which half of w13 (gate rows first, up rows second) or w2
EXPERT_PARTS = ("w1", "w3", "w2")  # Mixtral's names: gate, up, down


class FusedMoE(nn.Module):
    """``num_experts`` SiLU-gated MLPs of which each token runs its ``top_k`` (vLLM's FusedMoE).

    Weights: ``w13_weight [E, 2 I/tp, H]`` (this rank's gate rows, then its up rows) and
    ``w2_weight [E, H, I/tp]``. Tensor parallelism shards every expert's intermediate dimension,
    so each rank holds a partial sum of the combined output; ``forward`` all-reduces it unless
    ``reduce_results`` is off (a caller that adds a shared expert's partial sum first reduces once).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        reduce_results: bool = True,
        tp: TensorParallel = TensorParallel(),
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.reduce_results, self.tp = reduce_results, tp
        shard = tp.divide(intermediate_size, "moe_intermediate_size")
        self.intermediate_per_partition = shard
        # uninitialized: load_weights fills every expert and reports any it did not
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * shard, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, shard), requires_grad=False
        )

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: tuple[int, str] | None = None,
    ) -> None:
        """Copy one expert's full checkpoint matrix: ``shard_id = (expert, part)`` with part
        ``w1`` (gate ``[I, H]``), ``w3`` (up ``[I, H]``) or ``w2`` (down ``[H, I]``). Without a
        shard id the tensor is already stacked in this layer's layout, unsharded: ``[E, 2I, H]``
        for ``w13_weight``, ``[E, H, I]`` for ``w2_weight``."""
        if shard_id is None:
            self._load_stacked(param, loaded_weight)
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the model has {self.num_experts}")
        n, rank = self.intermediate_per_partition, self.tp.rank
        what = f"expert {expert} {part}"
        if part == "w2":
            check_shape(loaded_weight, (self.hidden_size, self.intermediate_size), what)
            copy_shard(param[expert], loaded_weight, 1, rank * n, n)
        elif part in ("w1", "w3"):
            check_shape(loaded_weight, (self.intermediate_size, self.hidden_size), what)
            offset = 0 if part == "w1" else n
            copy_shard(param[expert], loaded_weight, 0, rank * n, n, dst_start=offset)
        else:
            raise ValueError(f"unknown expert weight part {part!r}; expected one of {EXPERT_PARTS}")

    def _load_stacked(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        num_experts, inter, hidden = self.num_experts, self.intermediate_size, self.hidden_size
        if param is self.w2_weight:
            check_shape(loaded_weight, (num_experts, hidden, inter), "stacked w2_weight")
            for e in range(num_experts):
                self.weight_loader(param, loaded_weight[e], (e, "w2"))
            return
        check_shape(loaded_weight, (num_experts, 2 * inter, hidden), "stacked w13_weight")
        for e in range(num_experts):
            gate, up = loaded_weight[e].chunk(2, dim=0)
            self.weight_loader(param, gate, (e, "w1"))
            self.weight_loader(param, up, (e, "w3"))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (reduced over ranks unless
        ``reduce_results`` is off)."""
        topk_weights, topk_ids = ops.moe_route(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(hidden, topk_weights, topk_ids)

    def forward_routed(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts of a routing already made (``MoeRouter``'s fused path): ``topk_weights``
        float32 and ``topk_ids`` int32 ``[T, k]``."""
        out = ops.moe_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.reduce_results and self.tp.size > 1:
            out = get_forward_context().collective.all_reduce(out)
        return out
