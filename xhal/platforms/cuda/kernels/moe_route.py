"""Mixture-of-experts routing in Triton (``DeviceOps.moe_route``): each token's softmax over its
router logits in float32, the k largest in descending order (the lower expert index first on
ties), renormalized when asked. ``softmax_top_k`` is one token's routing as a Triton function,
shared with the fused norm + router kernel (``moe_router.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softmax_top_k(
    x, mask, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One token's routing from its float32 logits ``x [BLOCK_E]`` (``mask``: the real experts):
    ``(weights [BLOCK_K], ids [BLOCK_K])``, the first K slots used (``DeviceOps.moe_route``)."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.where(mask, x, -float("inf"))
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    remaining = tl.where(mask, p, -1.0)  # picked experts drop to -1: below every probability
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        # the first maximum: the lower expert index wins a tie; value and index in one reduction
        value, best = tl.max(
            remaining, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        top_w = tl.where(slots == j, value, top_w)
        top_i = tl.where(slots == j, best.to(tl.int32), top_i)
        remaining = tl.where(offs == best, -1.0, remaining)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(slots < K, top_w, 0.0), axis=0)
    return top_w, top_i


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, logits_stride,
    E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + token * logits_stride + offs, mask=mask, other=-float("inf"))
    top_w, top_i = softmax_top_k(x.to(tl.float32), mask, K, BLOCK_E, BLOCK_K, RENORMALIZE)
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + token * K + slots, top_w, mask=slots < K)
    tl.store(ids_ptr + token * K + slots, top_i, mask=slots < K)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k], ids int32 [T, k])`` as ``DeviceOps.moe_route`` defines them."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits,
            weights,
            ids,
            router_logits.stride(0),
            E=num_experts,
            K=top_k,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=max(2, triton.next_power_of_2(top_k)),
            RENORMALIZE=renormalize,
            # one warp up to 512 experts: the k + 2 reductions of a token stay in warp shuffles,
            # with no shared-memory round trip and barrier each (batch 1 pays them serially)
            num_warps=1 if num_experts <= 512 else 4,
        )
    return weights, ids
