"""TEST-ONLY plugin: the NPU platform's own code (``xhal.platforms.npu``) on the torch_npu
emulation.

``XHAL_PLUGINS=tests.support.npu_emulation.plugin`` (or ``xhal-conformance --plugin
tests.support.npu_emulation.plugin``) registers ``EmulatedNpuPlatform`` as "npu", replacing the
built-in. It is ``NpuPlatform`` unchanged except that its tensors live on the CPU (the emulated
device) and its collectives run on gloo; creating it installs the emulation (a ``torch_npu`` module
and a
``torch.npu`` namespace) and makes its DeviceOps the ones serving "cpu" tensors for the rest of
the process (ARCHITECTURE.md, "DeviceOps"), so the suite and the served model exercise the NPU ops,
not the CPU reference's.

The emulation is installed when the platform is created, not when this module is imported:
``import xhal; xhal.platforms.available()`` must import no ``torch_npu`` (the conformance
platform family checks it in a fresh interpreter with this plugin loaded).
"""

from __future__ import annotations

import torch

from xhal import ops, platforms
from xhal.platforms.npu.platform import NpuPlatform


class EmulatedNpuPlatform(NpuPlatform):
    device_type = "cpu"  # torch_npu.EMULATED_DEVICE
    dist_backend = "gloo"

    def __init__(self, activate_ops: bool = True) -> None:
        """``activate_ops=False`` leaves "cpu" served by whatever serves it now (for tests that
        create a platform of their own and scope its ops with ``xhal.ops.using``)."""
        from . import install  # the package this plugin was imported from (one copy per process)

        install()
        super().__init__()
        if (
            activate_ops
        ):  # ARCHITECTURE.md ("DeviceOps"): the emulated platform serves "cpu" while it runs
            ops.activate("cpu", self.ops)

    @classmethod
    def is_available(cls) -> bool:
        return True  # the emulation runs wherever torch does

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        super().set_device(0)  # one emulated device serves every rank of a gloo group


platforms.register("npu", EmulatedNpuPlatform, replace=True)
