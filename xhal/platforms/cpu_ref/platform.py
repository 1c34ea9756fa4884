"""The CPU reference platform. Its parts are imported when first used, as in every backend's
``platform.py``, so reading the class (its capabilities, ``is_available``) costs no more than the
interfaces."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.ops import DeviceOps
from xhal.interfaces.platform import AttentionCapabilities, Capabilities, Platform
from xhal.platforms.common.collective import SingleRankCollective, resolve_group

if TYPE_CHECKING:
    from xhal.platforms.cpu_ref.graph import CpuGraphRunner
    from xhal.solutions.kernels import Kernels


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    async_scheduling = False  # execute() runs synchronously: nothing to overlap with
    capabilities = Capabilities(
        attention=AttentionCapabilities(
            dtypes=(torch.float32, torch.bfloat16),
            head_dims=(16, 64, 128, 256),  # any head dim works; these are the ones tested
            any_head_dim=True,
            block_sizes=(16, 128),
            sliding_window=True,
            logits_soft_cap=True,
        ),
        notes=("reference implementation: correct, not fast",),
    )

    _kernels: Kernels | None = None
    # op -> solution a subclass forces (cpu-fast); XHAL_KERNEL_<OP> still overrides
    solution_defaults: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        self._ops: DeviceOps = self.kernels.ops

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def ops(self) -> DeviceOps:
        return self._ops

    @property
    def kernels(self) -> Kernels:
        if self._kernels is None:  # made on first use: a subclass may set its own ops instead
            from xhal.solutions.kernels import Kernels
            from xhal.solutions.solution import DeviceInfo

            device = DeviceInfo("cpu", name="cpu", library_versions=(("torch", torch.__version__),))
            self._kernels = Kernels(self, device, defaults=self.solution_defaults)
        return self._kernels

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        self.capabilities.attention.check(spec)
        return self.kernels.attention_backend(spec)

    def graph_runner(self) -> CpuGraphRunner:
        from xhal.platforms.cpu_ref.graph import CpuGraphRunner

        return CpuGraphRunner()

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        from xhal.platforms.cpu_ref.collective import GlooCollective

        group = resolve_group(group)
        return SingleRankCollective() if group is None else GlooCollective(group)

    def mem_get_info(self) -> tuple[int, int]:
        pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * page_size, os.sysconf("SC_PHYS_PAGES") * page_size
