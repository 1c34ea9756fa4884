"""Deliberately broken mixture-of-experts platforms: the conformance suite's moe family must fail
each of them. Import as a plugin (``xhal-conformance --plugin tests.support.broken_moe_platforms``).
Each is the CPU reference with one MoE bug of the kind a kernel author really writes:

- ``broken-moe-renorm``: "renormalize" divides the top-k probabilities by the sum over every
  expert (always 1), so the weights are never renormalized.
- ``broken-moe-gate-up``: the activation takes the up half of ``w13`` as the gate and vice versa.
- ``broken-moe-drop``: each expert computes at most one block (16) of its tokens; the rest of a
  crowded expert's tokens are silently dropped.
- ``broken-moe-norm-route``: the fused post-attention norm and router feeds the router the
  residual sum before the norm (the normed rows it returns are right).
- ``broken-moe-o-route``: the o projection fused with the router scales the residual sum by the
  rms of o's output instead of its own (a kernel that adds the residual after its sum of
  squares); the new residual it returns is right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xhal import platforms
from xhal.platforms.cpu_ref.ops import CpuOps
from xhal.platforms.cpu_ref.platform import CpuPlatform

BLOCK = 16


def _experts(x, w13, w2, topk_weights, topk_ids, *, swap_gate_up=False, max_tokens=None):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in range(w13.shape[0]):
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        if max_tokens is not None:  # BUG (broken-moe-drop): the expert's buffer is one block
            tokens, slots = tokens[:max_tokens], slots[:max_tokens]
        if tokens.numel() == 0:
            continue
        gate, up = (x[tokens].float() @ w13[expert].float().T).chunk(2, dim=-1)
        if swap_gate_up:  # BUG (broken-moe-gate-up): halves read in the wrong order
            gate, up = up, gate
        y = (F.silu(gate) * up) @ w2[expert].float().T
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(1))
    return out.to(x.dtype)


class _NoRenormOps(CpuOps):
    def moe_route(self, router_logits, top_k, renormalize):
        probs = torch.softmax(router_logits.float(), dim=-1)
        ids = probs.argsort(dim=-1, descending=True, stable=True)[:, :top_k]
        weights = probs.gather(1, ids)
        if renormalize:  # BUG: the sum over every expert, not over the k picked
            weights = weights / probs.sum(dim=-1, keepdim=True)
        return weights, ids.to(torch.int32)


class _SwappedGateUpOps(CpuOps):
    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        return _experts(x, w13, w2, topk_weights, topk_ids, swap_gate_up=True)


class _DropOverBlockOps(CpuOps):
    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        return _experts(x, w13, w2, topk_weights, topk_ids, max_tokens=BLOCK)


class _UnnormedRouterOps(CpuOps):
    def add_rms_norm_moe_route(
        self, x, residual, norm_weight, eps, gate_weight, top_k, renormalize
    ):
        normed, summed = self.fused_add_rms_norm(x, residual, norm_weight, eps)
        logits = self.linear(summed, gate_weight)  # BUG: the router reads the un-normed sum
        weights, ids = self.moe_route(logits, top_k, renormalize)
        return logits, normed, summed, weights, ids


class _OutOfOrderNormOps(CpuOps):
    def linear_add_rms_norm_moe_route(
        self, x, weight, residual, norm_weight, eps, gate_weight, top_k, renormalize
    ):
        o = self.linear(x, weight)
        summed = (o.float() + residual.float()).to(x.dtype)
        # BUG: the rms of o, before the residual joins it
        inv_rms = torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + eps)
        normed = (summed.float() * inv_rms * norm_weight.float()).to(x.dtype)
        logits = self.linear(normed, gate_weight)
        weights, ids = self.moe_route(logits, top_k, renormalize)
        return logits, normed, summed, weights, ids


class BrokenMoeRenormPlatform(CpuPlatform):
    name = "broken-moe-renorm"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _NoRenormOps()


class BrokenMoeGateUpPlatform(CpuPlatform):
    name = "broken-moe-gate-up"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _SwappedGateUpOps()


class BrokenMoeDropPlatform(CpuPlatform):
    name = "broken-moe-drop"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _DropOverBlockOps()


class BrokenMoeNormRoutePlatform(CpuPlatform):
    name = "broken-moe-norm-route"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _UnnormedRouterOps()


class BrokenMoeORoutePlatform(CpuPlatform):
    name = "broken-moe-o-route"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _OutOfOrderNormOps()


BROKEN_MOE_PLATFORMS = (
    BrokenMoeRenormPlatform,
    BrokenMoeGateUpPlatform,
    BrokenMoeDropPlatform,
    BrokenMoeNormRoutePlatform,
    BrokenMoeORoutePlatform,
)
for _cls in BROKEN_MOE_PLATFORMS:
    platforms.register(_cls.name, _cls)
