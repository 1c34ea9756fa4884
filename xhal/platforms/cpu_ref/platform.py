"""The CPU reference platform. Its parts are imported when first used, as in every backend's
``platform.py``, so reading the class (its capabilities, ``is_available``) costs no more than the
interfaces."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.platform import AttentionCapabilities, Capabilities, Platform
from xhal.platforms.common.collective import SingleRankCollective, resolve_group

if TYPE_CHECKING:
    from xhal.platforms.cpu_ref.attention import CpuAttention
    from xhal.platforms.cpu_ref.graph import CpuGraphRunner
    from xhal.platforms.cpu_ref.ops import CpuOps


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

    def __init__(self) -> None:
        from xhal.platforms.cpu_ref.ops import CpuOps

        self._ops = CpuOps()

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def ops(self) -> CpuOps:
        return self._ops

    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        self.capabilities.attention.check(spec)
        from xhal.platforms.cpu_ref.attention import CpuAttention

        return CpuAttention(spec)

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
