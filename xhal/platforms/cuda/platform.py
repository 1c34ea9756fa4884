"""The CUDA platform. ``cuda`` uses FlashInfer attention when it is installed (Triton otherwise);
``cuda-triton`` always uses the Triton fallback, so both paths can be proven by the suite."""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.distributed as dist

from xhal import env
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.platform import AttentionCapabilities, Capabilities, Platform
from xhal.platforms.common.collective import SingleRankCollective, resolve_group

logger = logging.getLogger(__name__)

_INSTALL = "pip install 'xhal[cuda]' (flashinfer-python==0.5.3 and triton)"
_WORKSPACE_BYTES = 128 * 1024 * 1024


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    capabilities = Capabilities(
        attention=AttentionCapabilities(
            dtypes=(torch.bfloat16, torch.float16, torch.float32),
            # FlashInfer runs 256 too, but the suite tests every declared head dim and 256 is not
            # in the prebuilt kernel bundle (minutes of JIT per variant): declared once verified
            head_dims=(64, 128),
            block_sizes=(16, 128),
            sliding_window=True,
            logits_soft_cap=True,
        ),
        ops_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        notes=("bf16/fp16 attention on FlashInfer when installed; float32 on the Triton kernel",),
    )
    use_flashinfer = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA platform needs a visible NVIDIA GPU and a CUDA build of torch")
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(f"the CUDA platform needs triton: {_INSTALL}")
        self.has_flashinfer = self.use_flashinfer and importlib.util.find_spec("flashinfer") is not None
        if self.use_flashinfer and not self.has_flashinfer:
            logger.warning("flashinfer is not installed: using Triton attention (%s)", _INSTALL)
        from xhal.platforms.cuda.ops import CudaOps, FlashInferOps

        self._ops = FlashInferOps() if self.has_flashinfer else CudaOps()
        self._workspace: torch.Tensor | None = None

    @classmethod
    def is_available(cls) -> bool:
        try:
            return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
        except Exception:
            return False

    @property
    def ops(self):
        return self._ops

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        self.capabilities.attention.check(spec)
        if self.has_flashinfer and spec.dtype in (torch.float16, torch.bfloat16):
            from xhal.platforms.cuda.attention import FlashInferAttention

            if self._workspace is None:  # one zeroed workspace shared by every wrapper
                self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device())
            return FlashInferAttention(spec, self._workspace, prefill_backend=env.flashinfer_prefill())
        from xhal.platforms.cuda.triton_attention import TritonAttention

        return TritonAttention(spec)

    def graph_runner(self):
        from xhal.platforms.cuda.graph import CudaGraphRunner

        return CudaGraphRunner()

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        from xhal.platforms.cuda.collective import NcclCollective

        group = resolve_group(group)
        return SingleRankCollective() if group is None else NcclCollective(group)

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()


class CudaTritonPlatform(CudaPlatform):
    name = "cuda-triton"
    use_flashinfer = False
