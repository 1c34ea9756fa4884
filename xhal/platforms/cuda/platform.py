"""The CUDA platform. Its kernels are solutions (``xhal/platforms/cuda/solutions.py``): ``cuda``
picks FlashInfer attention when it is installed (Triton otherwise); ``cuda-triton`` forces the
Triton attention, so both paths can be proven by the suite."""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import torch
import torch.distributed as dist

from xhal import env
from xhal.interfaces.attention import AttentionBackend, AttentionSpec
from xhal.interfaces.collective import Collective
from xhal.interfaces.platform import AttentionCapabilities, Capabilities, Platform
from xhal.platforms.common.collective import SingleRankCollective, resolve_group

_INSTALL = "pip install 'xhal[cuda]' (flashinfer-python==0.5.3 and triton)"


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

    # solutions this platform forces by default (XHAL_KERNEL_<OP> settings still win)
    solution_defaults: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the CUDA platform needs a visible NVIDIA GPU and a CUDA build of torch"
            )
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(f"the CUDA platform needs triton: {_INSTALL}")
        from xhal.solutions.kernels import Kernels

        self._kernels = Kernels(
            self,
            device_info(),
            defaults=self.solution_defaults,
            is_capturing=torch.cuda.is_current_stream_capturing,
        )
        self._ops = self._kernels.ops

    @classmethod
    def is_available(cls) -> bool:
        try:
            return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
        except Exception:  # noqa: BLE001  (is_available never raises, whatever a broken install does)
            return False

    @property
    def ops(self):
        return self._ops

    @property
    def kernels(self):
        return self._kernels

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        self.capabilities.attention.check(spec)
        return self._kernels.attention_backend(spec)

    def graph_runner(self):
        from xhal.platforms.cuda.graph import CudaGraphRunner

        return CudaGraphRunner()

    def collective(self, group: dist.ProcessGroup | None = None) -> Collective:
        from xhal.platforms.cuda.collective import NcclCollective, OneShotCollective

        group = resolve_group(group)
        if group is None:
            return SingleRankCollective()
        return (OneShotCollective if env.cuda_one_shot_allreduce() else NcclCollective)(group)

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class CudaTritonPlatform(CudaPlatform):
    """``cuda`` without FlashInfer: Triton attention, torch norms and activations (what the
    name meant before solutions; ``XHAL_KERNEL_<OP>`` picks any other mix on ``cuda``)."""

    name = "cuda-triton"
    solution_defaults: ClassVar[dict[str, str]] = {
        "paged_decode_attention": "triton",
        "paged_prefill_attention": "triton",
        "rms_norm": "torch",
        "silu_and_mul": "torch",
        "gelu_and_mul": "torch",
    }


def device_info(index: int | None = None):
    """The solutions' (and the autotuning cache's) description of CUDA device ``index`` (the
    current one when None): its name, compute capability and the library versions in use."""
    from importlib.metadata import PackageNotFoundError, version

    from xhal.solutions.solution import DeviceInfo

    versions = [("torch", torch.__version__), ("cuda", str(torch.version.cuda))]
    for package in ("triton", "flashinfer-python", "tilelang"):
        try:
            versions.append((package, version(package)))
        except PackageNotFoundError:
            pass
    index = torch.cuda.current_device() if index is None else index
    return DeviceInfo(
        "cuda",
        name=torch.cuda.get_device_name(index),
        compute_capability=torch.cuda.get_device_capability(index),
        library_versions=tuple(versions),
    )
