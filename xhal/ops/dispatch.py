"""Which ``DeviceOps`` serves each device type, and the per-device kernels of the ``xhal`` custom
ops that forward to it.

The active ops of a device type are the first platform's created for it (``register_platform``,
which the registry calls for each platform it creates: ``xhal.platforms.on_create``),
``cpu_ref``'s for ``cpu`` by default, or whichever ``activate`` / ``using`` selects (an emulated
device whose tensors live on the CPU makes its own ops active for ``cpu`` this way)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from xhal import platforms
from xhal.ops.library import LIBRARY

if TYPE_CHECKING:
    from xhal.interfaces.ops import DeviceOps
    from xhal.interfaces.platform import Platform

_active: dict[str, DeviceOps] = {}
_kernels_registered: set[str] = set()


def _register_kernels(device_type: str) -> None:
    if device_type in _kernels_registered:
        return
    torch.library.register_kernel(
        "xhal::rms_norm", device_type, lambda x, w, eps: active(x).rms_norm(x, w, eps), lib=LIBRARY
    )
    torch.library.register_kernel(
        "xhal::fused_add_rms_norm",
        device_type,
        lambda x, r, w, eps: active(x).fused_add_rms_norm(x, r, w, eps),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::rotary_embedding",
        device_type,
        lambda pos, q, k, cs, neox: active(q).rotary_embedding(pos, q, k, cs, neox),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::silu_and_mul", device_type, lambda x: active(x).silu_and_mul(x), lib=LIBRARY
    )
    torch.library.register_kernel(
        "xhal::gelu_and_mul",
        device_type,
        lambda x, approximate="none": active(x).gelu_and_mul(x, approximate),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::add_rms_norm_linear",
        device_type,
        lambda x, r, g, eps, w, b=None: active(x).add_rms_norm_linear(x, r, g, eps, w, b),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::silu_and_mul_linear",
        device_type,
        lambda x, w, b=None: active(x).silu_and_mul_linear(x, w, b),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::qk_rms_norm",
        device_type,
        lambda q, k, qw, kw, eps: active(q).qk_rms_norm(q, k, qw, kw, eps),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::moe_route",
        device_type,
        lambda logits, k, renorm: active(logits).moe_route(logits, k, renorm),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::add_rms_norm_moe_route",
        device_type,
        lambda x, r, g, eps, w, k, renorm: active(x).add_rms_norm_moe_route(
            x, r, g, eps, w, k, renorm
        ),
        lib=LIBRARY,
    )
    torch.library.register_kernel(
        "xhal::moe_experts",
        device_type,
        lambda x, w13, w2, tw, ti: active(x).moe_experts(x, w13, w2, tw, ti),
        lib=LIBRARY,
    )
    _kernels_registered.add(device_type)


def register_platform(platform: Platform) -> None:
    """Register kernels for the platform's device type; its ops become active there unless another
    platform already is. Called for every platform ``xhal.platforms.get`` creates."""
    _register_kernels(platform.device_type)
    _active.setdefault(platform.device_type, platform.ops)


def active(x: torch.Tensor | str) -> DeviceOps:
    """The ``DeviceOps`` serving tensors on ``x``'s device type."""
    device_type = x if isinstance(x, str) else x.device.type
    if device_type not in _active:
        if device_type == "cpu":
            platforms.get("cpu")  # its creation makes cpu_ref's ops active (register_platform)
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
platforms.on_create(register_platform)
