"""``oot-cpu``: a platform of its own built from the CPU reference's pieces.

A real backend replaces the pieces one by one (its attention kernel first, usually) and keeps
the conformance suite green at each step; the capabilities below are what it promises meanwhile.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from xhal.interfaces import AttentionSpec, Collective, Platform
from xhal.interfaces.platform import AttentionCapabilities, Capabilities
from xhal.platforms.common.collective import SingleRankCollective, resolve_group
from xhal.platforms.cpu_ref.attention import CpuAttention
from xhal.platforms.cpu_ref.collective import GlooCollective
from xhal.platforms.cpu_ref.graph import CpuGraphRunner
from xhal.platforms.cpu_ref.ops import CpuOps


class OotPlatform(Platform):
    name = "oot-cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # Narrower than the reference on purpose: the suite tests exactly what is declared here and
    # skips the rest (bfloat16, head dim 256, block size 128, sliding window, soft cap).
    capabilities = Capabilities(
        attention=AttentionCapabilities(
            dtypes=(torch.float32,),
            head_dims=(64, 128),
            block_sizes=(16,),
            block_size_multiple=16,
        ),
        ops_dtypes=(torch.float32,),
        notes=("example out-of-tree platform: cpu_ref pieces, narrower capabilities",),
    )

    def __init__(self) -> None:
        # Device libraries would be imported here, failing with the package name and the pip
        # command; this example needs nothing beyond torch.
        self._ops = CpuOps()

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def ops(self) -> CpuOps:
        return self._ops

    def attention_backend(self, spec: AttentionSpec) -> CpuAttention:
        # raises ValueError naming what is supported (dtype, head_dim, block size, and the
        # sliding window and soft cap this platform does not declare), as the contract requires
        self.capabilities.attention.check(spec)
        return CpuAttention(spec)

    def graph_runner(self) -> CpuGraphRunner:
        return CpuGraphRunner()

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        group = resolve_group(group)  # None: torch.distributed is not initialized, one rank
        return SingleRankCollective() if group is None else GlooCollective(group)

    def mem_get_info(self) -> tuple[int, int]:
        pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * page_size, os.sysconf("SC_PHYS_PAGES") * page_size
