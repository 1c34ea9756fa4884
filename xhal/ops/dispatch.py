"""Which ``DeviceOps`` serves each device type, and the per-device kernels of the ``xhal`` custom
ops that forward to it.

The active ops of a device type are the first platform's created for it (``register_platform``,
which the registry calls for each platform it creates: ``xhal.platforms.on_create``),
``cpu_ref``'s for ``cpu`` by default, or whichever ``activate`` / ``using`` selects (an emulated
device whose tensors live on the CPU makes its own ops active for ``cpu`` this way)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from xhal import platforms
from xhal.ops.library import LIBRARY

if TYPE_CHECKING:
    from xhal.interfaces.ops import DeviceOps
    from xhal.interfaces.platform import Platform

_active: dict[str, DeviceOps] = {}
_kernels_registered: set[str] = set()


# every op's kernel calls the DeviceOps method of the op's own name on the ops active for its
# device type, read at each call (``using`` and ``activate`` swap them between calls)
_OPS = (
    "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul",
    "add_rms_norm_linear", "silu_and_mul_linear", "add_rms_norm_gated_mlp", "qk_rms_norm",
    "moe_route",
    "add_rms_norm_moe_route", "linear_add_rms_norm_moe_route", "moe_experts",
)


def _kernel(device_type: str, op: str) -> Callable[..., object]:
    def kernel(*args: object) -> object:
        ops = _active.get(device_type)
        if ops is None:  # only "cpu" gets here before a platform exists: ``active`` makes one
            ops = active(device_type)
        return getattr(ops, op)(*args)

    kernel.__name__ = f"xhal_{op}_{device_type}"
    return kernel


def _register_kernels(device_type: str) -> None:
    """Register the forwarding kernel of every op for ``device_type``'s dispatch key.

    ``Library.impl`` rather than ``torch.library.register_kernel``: the latter wraps each kernel
    in a ``torch._dynamo`` disable context that is entered on every call (about 3 us of the
    ~5 us a custom op costs here, a hundred-odd times per eager decode step) against dynamo
    tracing into the kernel; tracing never reaches it: torch.compile sees each op as one opaque
    call through its fake implementation (``library.py``)."""
    if device_type in _kernels_registered:
        return
    key = torch._C._dispatch_key_for_device(device_type)
    for op in _OPS:
        LIBRARY.impl(op, _kernel(device_type, op), key)
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


def active_cpu() -> DeviceOps:
    """``active("cpu")`` with the common case first (the eager CPU route of ``xhal.ops``)."""
    ops = _active.get("cpu")
    return active("cpu") if ops is None else ops


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
