"""``cuda-tilelang``: the CUDA platform with TileLang's solutions where they exist (paged decode
attention, fused residual add + RMSNorm) and the Triton ones elsewhere (prefill attention, the
other DeviceOps). TileLang kernels are JIT-compiled on this machine for the shapes that occur.

Without TileLang installed the platform still runs, on the Triton solutions, and says once what
is missing: the same numerics contract, one log line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch

from xhal.cuda.platform import CudaTritonPlatform
from xhal.interfaces.attention import AttentionBackend, AttentionSpec

logger = logging.getLogger(__name__)

INSTALL = (
    "pip install tilelang==0.1.15 (with z3-solver, apache-tvm-ffi 0.1.12, ml-dtypes, "
    "torch-c-dlpack-ext; scripts/fetch_tilelang_wheels.sh for a machine without network)"
)
_warned = False


def tilelang_missing() -> str | None:
    """What keeps TileLang from running here, or None."""
    if importlib.util.find_spec("tilelang") is None:
        return f"tilelang is not installed ({INSTALL})"
    return None


class CudaTileLangPlatform(CudaTritonPlatform):
    name = "cuda-tilelang"
    capabilities = dataclasses.replace(
        CudaTritonPlatform.capabilities,
        attention=dataclasses.replace(
            CudaTritonPlatform.capabilities.attention,
            dtypes=(torch.bfloat16, torch.float16),
            head_dims=(128,),
            sliding_window=False,
            logits_soft_cap=False,
        ),
        notes=(
            (
                "decode attention and fused add+RMSNorm on TileLang (JIT), prefill attention and "
                "other ops on Triton; without tilelang everything on Triton"
            ),
        ),
    )

    def __init__(self) -> None:
        global _warned
        super().__init__()
        self.missing = tilelang_missing()
        if self.missing is None:
            from xhal.cuda.tilelang_ops import TileLangOps

            self._ops = TileLangOps()
        elif not _warned:
            _warned = True
            logger.warning("cuda-tilelang: %s; decode attention and fused add+RMSNorm run on Triton", self.missing)

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        self.capabilities.attention.check(spec)
        from xhal.cuda.attention import TritonAttention

        fallback = TritonAttention(spec)
        if self.missing is not None:
            return fallback
        from xhal.cuda.tilelang_attention import TileLangAttention

        sms = torch.cuda.get_device_properties(self.device()).multi_processor_count
        return TileLangAttention(spec, fallback, sms)
