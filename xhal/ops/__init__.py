"""Device ops as ``torch.library`` custom ops, dispatched by PyTorch on the tensors' device.

Layers call ``xhal.ops.rms_norm(x, w, eps)`` and friends. Each op has a fake (meta)
implementation for tracing (``library.py``), and a kernel per device type that forwards to the
``DeviceOps`` of the platform *active* for that device type (``dispatch.py``): the first platform
created for it, ``cpu_ref`` for ``cpu`` by default, or whichever ``using(...)`` selects (an
emulated device whose tensors live on the CPU makes its own ops active for ``cpu`` this way).

Sampling (``argmax``, ``sample``) takes a ``torch.Generator``, which custom-op schemas cannot carry,
so it is routed the same way by a plain function instead of through the dispatcher.

Each function calls its op's overload (``torch.ops.xhal.<op>.default``) rather than the overload
packet: the packet's overload resolution costs more per call than the dispatcher itself (on this
project's CPU, rms_norm of one row: 27.6 us through the packet, 21.4 through the overload, 18.1
for the DeviceOps method alone), and that is paid a hundred-odd times per decode step in eager code.

Eager calls on plain CPU tensors skip the dispatcher altogether (``_eager_cpu``): the kernel it
would reach only calls the active CPU ops' method, so they call it themselves (about 7 us less
per call here, three or four calls per decoder layer). Whatever could observe the call still
sees the custom op: torch.compile (``is_compiling``), a ``TorchDispatchMode`` (the CPU graph
recorder, fake-tensor tracing) and tensor subclasses (fake and functional tensors) all take
the dispatcher, and non-CPU devices always do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from xhal.ops.dispatch import activate, active, active_cpu, register_platform, using

if TYPE_CHECKING:
    from xhal.interfaces.ops import DeviceOps

_XHAL = torch.ops.xhal  # the namespace ``library.py`` defines, imported with ``dispatch``
_Tensor = torch.Tensor
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_compiling = torch.compiler.is_compiling


def _eager_cpu(x: torch.Tensor) -> DeviceOps | None:
    """The active CPU ops when ``x`` is a plain CPU tensor and nothing traces or records the
    call (then calling their method is exactly what the dispatched kernel would do), else None."""
    if type(x) is _Tensor and x.is_cpu and not _dispatch_modes() and not _is_compiling():
        return active_cpu()
    return None


def _route(op: str, x: torch.Tensor, *args: Any) -> Any:
    """``op(*args)``: the active CPU ops' method when ``_eager_cpu(x)`` serves the call, else the
    custom op's overload (``torch.ops.xhal.<op>.default``) through the dispatcher."""
    ops = _eager_cpu(x)
    if ops is not None:
        return getattr(ops, op)(*args)
    return getattr(_XHAL, op).default(*args)


__all__ = [
    "activate",
    "active",
    "add_rms_norm_gated_mlp",
    "add_rms_norm_linear",
    "add_rms_norm_moe_route",
    "argmax",
    "fused_add_rms_norm",
    "gelu_and_mul",
    "linear",
    "linear_add_rms_norm_moe_route",
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
    return (active_cpu() if x.is_cpu else active(x)).linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _route("rms_norm", x, x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _route("fused_add_rms_norm", x, x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # q, not positions: a CPU positions tensor may go with device q
    return _route("rotary_embedding", q, positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _route("silu_and_mul", x, x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return _route("gelu_and_mul", x, x, approximate)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _route("add_rms_norm_linear", x, x, residual, norm_weight, eps, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _route("silu_and_mul_linear", x, x, weight, bias)


def add_rms_norm_gated_mlp(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(
        "add_rms_norm_gated_mlp", x, x, residual, norm_weight, eps, gate_up_weight, down_weight,
        gate_up_bias, down_bias,
    )  # fmt: skip


def qk_rms_norm(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _route("qk_rms_norm", q, q, k, q_weight, k_weight, eps)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _route("moe_route", router_logits, router_logits, top_k, renormalize)


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
    return _route(
        "add_rms_norm_moe_route", x, x, residual, norm_weight, eps, gate_weight, top_k, renormalize
    )


def linear_add_rms_norm_moe_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm_moe_route(linear(x, weight), residual, ...)``: see ``DeviceOps``."""
    return _route(
        "linear_add_rms_norm_moe_route", x, x, weight, residual, norm_weight, eps, gate_weight,
        top_k, renormalize,
    )  # fmt: skip


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return _route("moe_experts", x, x, w13, w2, topk_weights, topk_ids)


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
