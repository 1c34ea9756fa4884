"""``cuda-tilelang``: the CUDA platform with TileLang's solutions forced where they exist (paged
decode attention, fused residual add + RMSNorm) and the Triton / torch ones elsewhere (prefill
attention, the other DeviceOps), as ``cuda-triton`` is the platform with Triton forced. TileLang
kernels are JIT-compiled on this machine for the shapes that occur; on ``cuda`` the same
solutions are registered (``solutions.py``) and chosen by priority or ``XHAL_KERNEL_<OP>``.

Without TileLang installed the platform still runs, on the Triton solutions, and says once what
is missing: the same numerics contract, one log line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import ClassVar

import torch

from xhal.platforms.cuda.platform import CudaTritonPlatform
from xhal.platforms.cuda.solutions import TILELANG

logger = logging.getLogger(__name__)

_warned = False


def tilelang_missing() -> str | None:
    """What keeps TileLang from running here, or None."""
    if importlib.util.find_spec("tilelang") is None:
        return f"tilelang is not installed ({TILELANG.install})"
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
    solution_defaults: ClassVar[dict[str, str]] = {
        **CudaTritonPlatform.solution_defaults,
        "paged_decode_attention": "tilelang",
        "fused_add_rms_norm": "tilelang",
    }

    def __init__(self) -> None:
        global _warned
        self.missing = tilelang_missing()
        if self.missing is not None:
            # the instance's defaults shadow the class's: Triton's, as on cuda-triton
            self.solution_defaults = dict(CudaTritonPlatform.solution_defaults)
            if not _warned:
                _warned = True
                logger.warning(
                    "cuda-tilelang: %s; decode attention and fused add+RMSNorm run on Triton",
                    self.missing,
                )
        super().__init__()
