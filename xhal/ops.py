"""Device ops as ``torch.library`` custom ops, dispatched by PyTorch on the tensors' device.

Layers call ``xhal.ops.rms_norm(x, w, eps)`` and friends. Each op has a fake (meta)
implementation for tracing, and a kernel per device type that forwards to the ``DeviceOps`` of
the platform *active* for that device type: the first platform created for it, ``cpu_ref`` for
``cpu`` by default, or whichever ``using(...)`` selects (an emulated device whose tensors live on
the CPU makes its own ops active for ``cpu`` this way).

Sampling (``argmax``, ``sample``) takes a ``torch.Generator``, which custom-op schemas cannot carry,
so it is routed the same way by a plain function instead of through the dispatcher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from xhal.interfaces.ops import DeviceOps
    from xhal.interfaces.platform import Platform

_SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"
    ),
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, bool is_neox)"
        " -> (Tensor, Tensor)"
    ),
    "silu_and_mul": "silu_and_mul(Tensor x) -> Tensor",
    "gelu_and_mul": "gelu_and_mul(Tensor x, str approximate='none') -> Tensor",
    "add_rms_norm_linear": (
        "add_rms_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight,"
        " Tensor? bias=None) -> (Tensor, Tensor)"
    ),
    "silu_and_mul_linear": "silu_and_mul_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    "moe_route": "moe_route(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)",
    "moe_experts": (
        "moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids)"
        " -> Tensor"
    ),
}

_lib = torch.library.Library("xhal", "DEF")
for _schema in _SCHEMAS.values():
    _lib.define(_schema)


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


_active: dict[str, DeviceOps] = {}
_kernels_registered: set[str] = set()


def _register_kernels(device_type: str) -> None:
    if device_type in _kernels_registered:
        return
    torch.library.register_kernel(
        "xhal::rms_norm", device_type, lambda x, w, eps: active(x).rms_norm(x, w, eps), lib=_lib
    )
    torch.library.register_kernel(
        "xhal::fused_add_rms_norm",
        device_type,
        lambda x, r, w, eps: active(x).fused_add_rms_norm(x, r, w, eps),
        lib=_lib,
    )
    torch.library.register_kernel(
        "xhal::rotary_embedding",
        device_type,
        lambda pos, q, k, cs, neox: active(q).rotary_embedding(pos, q, k, cs, neox),
        lib=_lib,
    )
    torch.library.register_kernel(
        "xhal::silu_and_mul", device_type, lambda x: active(x).silu_and_mul(x), lib=_lib
    )
    torch.library.register_kernel(
        "xhal::gelu_and_mul",
        device_type,
        lambda x, approximate="none": active(x).gelu_and_mul(x, approximate),
        lib=_lib,
    )
    torch.library.register_kernel(
        "xhal::add_rms_norm_linear",
        device_type,
        lambda x, r, g, eps, w, b=None: active(x).add_rms_norm_linear(x, r, g, eps, w, b),
        lib=_lib,
    )
    torch.library.register_kernel(
        "xhal::silu_and_mul_linear",
        device_type,
        lambda x, w, b=None: active(x).silu_and_mul_linear(x, w, b),
        lib=_lib,
    )
    torch.library.register_kernel(
        "xhal::moe_route",
        device_type,
        lambda logits, k, renorm: active(logits).moe_route(logits, k, renorm),
        lib=_lib,
    )
    torch.library.register_kernel(
        "xhal::moe_experts",
        device_type,
        lambda x, w13, w2, tw, ti: active(x).moe_experts(x, w13, w2, tw, ti),
        lib=_lib,
    )
    _kernels_registered.add(device_type)


def register_platform(platform: Platform) -> None:
    """Register kernels for the platform's device type; its ops become active there unless another
    platform already is. Called by ``xhal.platforms.get``."""
    _register_kernels(platform.device_type)
    _active.setdefault(platform.device_type, platform.ops)


def active(x: torch.Tensor | str) -> DeviceOps:
    """The ``DeviceOps`` serving tensors on ``x``'s device type."""
    device_type = x if isinstance(x, str) else x.device.type
    if device_type not in _active:
        if device_type == "cpu":
            from xhal import platforms

            platforms.get("cpu")
        else:
            raise RuntimeError(
                f"no xhal platform serves device type {device_type!r}; create one first, e.g. "
                f"xhal.platforms.get({device_type!r})"
            )
    return _active[device_type]


def activate(device_type: str, ops: DeviceOps) -> DeviceOps | None:
    """Make ``ops`` serve ``device_type`` from now on; returns what served it before (if any).
    An emulated device whose tensors live on the CPU activates its ops for "cpu" this way."""
    _register_kernels(device_type)
    previous = _active.get(device_type)
    _active[device_type] = ops
    return previous


@contextlib.contextmanager
def using(device_type: str, ops: DeviceOps) -> Iterator[None]:
    """Make ``ops`` serve ``device_type`` inside the block (restored on exit)."""
    _register_kernels(device_type)
    previous = _active.get(device_type)
    _active[device_type] = ops
    try:
        yield
    finally:
        if previous is None:
            del _active[device_type]
        else:
            _active[device_type] = previous


# the CPU is always there: its kernels exist from import on and serve cpu_ref until another
# platform is made active for "cpu"
_register_kernels("cpu")


# The public ops ------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # routed in Python, not a custom op: the default is torch's own GEMM, whose dispatch a
    # custom op would only add to
    return active(x).linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.xhal.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.xhal.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.xhal.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.xhal.silu_and_mul(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return torch.ops.xhal.gelu_and_mul(x, approximate)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.xhal.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.xhal.silu_and_mul_linear(x, weight, bias)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.xhal.moe_route(router_logits, top_k, renormalize)


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
