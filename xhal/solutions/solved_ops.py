"""``DeviceOps`` assembled from one chosen implementation per op."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from xhal.interfaces.ops import DeviceOps
from xhal.solutions.op_names import OPS

# the ops every DeviceOps has; an op added later (a fused one) needs only its entry in OPS
REQUIRED = (
    "linear", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul",
    "moe_route", "moe_experts", "sampling",
)


class SolvedOps(DeviceOps):
    """Each op is the implementation chosen for it once, at construction, bound as an instance
    attribute named by ``OPS`` (it shadows the forwarding method of the class): a call goes
    straight to the implementation, never through a selection or an extra Python frame (op calls
    are a decode step's hot path). An op beyond ``REQUIRED`` without a chosen solution is the
    ``DeviceOps`` default (a fused op's default is the plain sequence of chosen ops). The methods
    below forward the same way, for the ABC and for readers."""

    def __init__(self, impls: Mapping[str, Callable], names: Mapping[str, str]) -> None:
        missing = [op for op in REQUIRED if op not in impls]
        if missing:
            raise ValueError(
                f"SolvedOps needs an implementation of every device op; missing: {missing}"
            )
        self.names = dict(names)  # op -> solution name, for logs and reports
        self.impls = dict(impls)  # op -> implementation (a TunedOp for a solution with configs)
        self._linear = impls["linear"]
        self._rms_norm = impls["rms_norm"]
        self._fused_add_rms_norm = impls["fused_add_rms_norm"]
        self._rotary_embedding = impls["rotary_embedding"]
        self._silu_and_mul = impls["silu_and_mul"]
        self._gelu_and_mul = impls["gelu_and_mul"]
        self._moe_route = impls["moe_route"]
        self._moe_experts = impls["moe_experts"]
        self._sample = impls["sampling"]
        for op, impl in impls.items():
            setattr(self, OPS[op], impl)

    def linear(self, x, weight, bias=None):
        return self._linear(x, weight, bias)

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return self._fused_add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        return self._rotary_embedding(positions, q, k, cos_sin_cache, is_neox)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)

    def gelu_and_mul(self, x, approximate="none"):
        return self._gelu_and_mul(x, approximate)

    def moe_route(self, router_logits, top_k, renormalize):
        return self._moe_route(router_logits, top_k, renormalize)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        return self._moe_experts(x, w13, w2, topk_weights, topk_ids)

    def sample(self, logits, temperature, top_k, top_p, generator=None):
        return self._sample(logits, temperature, top_k, top_p, generator)
