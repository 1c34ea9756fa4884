"""HCCL collectives on plain ``torch.distributed`` (vllm-ascend's NPUCommunicator does the same;
the op documentation has nothing on HCCL). Never issued inside an FIA task group: HCCL there fails
graph capture (vllm-ascend #13688)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from xhal.platforms.common.collective import TensorCollective


class HcclCollective(TensorCollective):
    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group)
        # HCCL communicators are built lazily by the first collective, and lazy init under
        # contention fails (error code 7, as vllm-ascend reports): warm this group up now, once
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm, group=group)
