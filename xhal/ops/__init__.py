"""Device ops as ``torch.library`` custom ops, dispatched by PyTorch on the tensors' device.

Layers call ``xhal.ops.rms_norm(x, w, eps)`` and friends. Each op has a fake (meta)
implementation for tracing (``library.py``), and a kernel per device type that forwards to the
``DeviceOps`` of the platform *active* for that device type (``dispatch.py``): the first platform
created for it, ``cpu_ref`` for ``cpu`` by default, or whichever ``using(...)`` selects (an
emulated device whose tensors live on the CPU makes its own ops active for ``cpu`` this way).

Sampling (``argmax``, ``sample``) takes a ``torch.Generator``, which custom-op schemas cannot carry,
so it is routed the same way by a plain function instead of through the dispatcher.

The ops of an eager platform that declares ``DeviceOps.direct_eager_calls`` (``cpu-fast``) are
called directly in eager code (``dispatch.direct``): the same ``DeviceOps`` method the kernel
would forward to, without the dispatcher's round trip.
"""

from __future__ import annotations

import torch

from xhal.ops.dispatch import activate, active, direct, register_platform, using

__all__ = [
    "activate",
    "active",
    "add_rms_norm_linear",
    "add_rms_norm_moe_route",
    "argmax",
    "fused_add_rms_norm",
    "gelu_and_mul",
    "linear",
    "moe_experts",
    "moe_route",
    "qk_rms_norm",
    "register_platform",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul_linear",
    "sample",
    "silu_and_mul",
    "using",
]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # routed in Python, not a custom op: the default is torch's own GEMM, whose dispatch a
    # custom op would only add to
    return active(x).linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (ops := direct(x)) is not None:
        return ops.rms_norm(x, weight, eps)
    return torch.ops.xhal.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (ops := direct(x)) is not None:
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    return torch.ops.xhal.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if (ops := direct(q)) is not None:
        return ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    return torch.ops.xhal.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if (ops := direct(x)) is not None:
        return ops.silu_and_mul(x)
    return torch.ops.xhal.silu_and_mul(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if (ops := direct(x)) is not None:
        return ops.gelu_and_mul(x, approximate)
    return torch.ops.xhal.gelu_and_mul(x, approximate)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if (ops := direct(x)) is not None:
        return ops.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    return torch.ops.xhal.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if (ops := direct(x)) is not None:
        return ops.silu_and_mul_linear(x, weight, bias)
    return torch.ops.xhal.silu_and_mul_linear(x, weight, bias)


def qk_rms_norm(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.xhal.qk_rms_norm(q, k, q_weight, k_weight, eps)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.xhal.moe_route(router_logits, top_k, renormalize)


def add_rms_norm_moe_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router_logits, normed, new residual, topk_weights, topk_ids)``: see ``DeviceOps``."""
    return torch.ops.xhal.add_rms_norm_moe_route(
        x, residual, norm_weight, eps, gate_weight, top_k, renormalize
    )


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return torch.ops.xhal.moe_experts(x, w13, w2, topk_weights, topk_ids)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return active(logits).argmax(logits)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    return active(logits).sample(logits, temperature, top_k, top_p, generator)
