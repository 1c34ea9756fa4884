"""The ``xhal`` custom-op library: each op's schema and its fake (meta) implementation for
tracing. The per-device kernels are registered by ``dispatch.py``."""

from __future__ import annotations

import torch

_SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, "
        "Tensor)"
    ),
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, bool is_neox)"
        " -> (Tensor, Tensor)"
    ),
    "silu_and_mul": "silu_and_mul(Tensor x) -> Tensor",
    "gelu_and_mul": "gelu_and_mul(Tensor x, str approximate='none') -> Tensor",
    "add_rms_norm_linear": (
        "add_rms_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor "
        "weight,"
        " Tensor? bias=None) -> (Tensor, Tensor)"
    ),
    "silu_and_mul_linear": "silu_and_mul_linear(Tensor x, Tensor weight, Tensor? bias=None) -> "
                           "Tensor",
    "add_rms_norm_gated_mlp": (
        "add_rms_norm_gated_mlp(Tensor x, Tensor residual, Tensor norm_weight, float eps, "
        "Tensor gate_up_weight, Tensor down_weight, Tensor? gate_up_bias=None, "
        "Tensor? down_bias=None) -> (Tensor, Tensor)"
    ),
    "qk_rms_norm": (
        "qk_rms_norm(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps) -> (Tensor, "
        "Tensor)"
    ),
    "moe_route": "moe_route(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)",
    "add_rms_norm_moe_route": (
        "add_rms_norm_moe_route(Tensor x, Tensor residual, Tensor norm_weight, float eps, "
        "Tensor gate_weight, int top_k, bool renormalize) -> (Tensor, Tensor, Tensor, Tensor, "
        "Tensor)"
    ),
    "linear_add_rms_norm_moe_route": (
        "linear_add_rms_norm_moe_route(Tensor x, Tensor weight, Tensor residual, "
        "Tensor norm_weight, float eps, Tensor gate_weight, int top_k, bool renormalize) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "moe_experts": (
        "moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids)"
        " -> Tensor"
    ),
}

# every xhal custom op lives in this one namespace, ``torch.ops.xhal``
LIBRARY = torch.library.Library("xhal", "DEF")
for _schema in _SCHEMAS.values():
    LIBRARY.define(_schema)


@torch.library.register_fake("xhal::rms_norm")
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("xhal::fused_add_rms_norm")
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("xhal::rotary_embedding")
def _(positions, q, k, cos_sin_cache, is_neox):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("xhal::silu_and_mul")
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.register_fake("xhal::gelu_and_mul")
def _(x, approximate="none"):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.register_fake("xhal::add_rms_norm_linear")
def _(x, residual, norm_weight, eps, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x)


@torch.library.register_fake("xhal::add_rms_norm_gated_mlp")
def _(x, residual, norm_weight, eps, gate_up_weight, down_weight, gate_up_bias=None,
      down_bias=None):  # fmt: skip
    return x.new_empty(*x.shape[:-1], down_weight.shape[0]), torch.empty_like(x)


@torch.library.register_fake("xhal::silu_and_mul_linear")
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("xhal::moe_route")
def _(router_logits, top_k, renormalize):
    num_tokens = router_logits.shape[0]
    return (
        router_logits.new_empty(num_tokens, top_k, dtype=torch.float32),
        router_logits.new_empty(num_tokens, top_k, dtype=torch.int32),
    )


@torch.library.register_fake("xhal::moe_experts")
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


def _routing_outputs(residual, gate_weight, top_k):
    """The fused routers' outputs: logits [T, E], normed and new residual like ``residual``,
    weights float32 and ids int32 [T, k]."""
    num_tokens = residual.shape[0]
    return (
        residual.new_empty(num_tokens, gate_weight.shape[0]),
        torch.empty_like(residual),
        torch.empty_like(residual),
        residual.new_empty(num_tokens, top_k, dtype=torch.float32),
        residual.new_empty(num_tokens, top_k, dtype=torch.int32),
    )


@torch.library.register_fake("xhal::add_rms_norm_moe_route")
def _(x, residual, norm_weight, eps, gate_weight, top_k, renormalize):
    return _routing_outputs(residual, gate_weight, top_k)


@torch.library.register_fake("xhal::linear_add_rms_norm_moe_route")
def _(x, weight, residual, norm_weight, eps, gate_weight, top_k, renormalize):
    return _routing_outputs(residual, gate_weight, top_k)


@torch.library.register_fake("xhal::qk_rms_norm")
def _(q, k, q_weight, k_weight, eps):
    return q.new_empty(q.shape), k.new_empty(k.shape)
