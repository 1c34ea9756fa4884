"""TEST-ONLY plugin: "cuda-fused-interpreted", the CUDA platform's fused decode kernels
(``xhal.platforms.cuda.kernels.fused_gemv``: RMSNorm / SiLU gate fused into the GEMV; ``rotary_kv``:
rotary fused into the KV write, through ``TritonAttention.forward_rotary``; ``qk_norm``: Qwen3's
q and k norms in one launch) run by Triton's
interpreter on CPU tensors; everything else is the CPU reference.

``xhal-conformance --device cuda-fused-interpreted --plugin
tests.support.triton_fused_interpreted_platform --family fused`` proves the kernels against the
fused family's float64 references on any CPU. Each fused op runs with a forced K split of 2 where K
allows it, so the split-K reduce (the sum of squares carried to it) is exercised at these small
shapes too. Graphs are declared off, as in ``triton_interpreted_platform``: an interpreted kernel is
not a torch op the CPU graph runner can record.
"""

from __future__ import annotations

import dataclasses
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from xhal import platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.interfaces.metadata import BatchKind
from xhal.platforms.cpu_ref.ops import CpuOps
from xhal.platforms.cpu_ref.platform import CpuPlatform


def _config(m: int, k: int) -> tuple[int, int, int, int, int]:
    from xhal.platforms.cuda.kernels import fused_gemv

    cfg = fused_gemv.fused_gemv_config(m, 64, k)
    block_k = min(cfg.block_k, 64)
    return (cfg.block_n, block_k, 2 if k > block_k else 1, 4, 2)


_REFERENCE = CpuOps()


class FusedInterpretedOps(CpuOps):
    def add_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        from xhal.platforms.cuda.kernels import fused_gemv

        if x.dim() != 2 or not fused_gemv.supports(x, weight):
            return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
        cfg = _config(x.shape[0], x.shape[1])
        return fused_gemv.add_rms_norm_gemv(x, residual, norm_weight, eps, weight, bias, config=cfg)

    def silu_and_mul_linear(self, x, weight, bias=None):
        from xhal.platforms.cuda.kernels import fused_gemv

        if x.dim() != 2 or not fused_gemv.supports(x, weight, gated=True):
            return super().silu_and_mul_linear(x, weight, bias)
        return fused_gemv.silu_and_mul_gemv(
            x, weight, bias, config=_config(x.shape[0], x.shape[1] // 2)
        )

    def add_rms_norm_gated_mlp(self, *args):
        # the block is its two fused ops, each proven interpreted by test_fused.py's own cases;
        # the block's cases run on the reference here (interpreted, they took about 20 s more)
        return CpuOps.add_rms_norm_gated_mlp(_REFERENCE, *args)


    def qk_rms_norm(self, q, k, q_weight, k_weight, eps):
        from xhal.platforms.cuda.kernels import qk_norm

        if not qk_norm.supports(q, k, q_weight):
            return super().qk_rms_norm(q, k, q_weight, k_weight, eps)
        return qk_norm.qk_rms_norm(q, k, q_weight, k_weight, eps)


# XHAL_FUSED_TEST_DTYPES narrows the dtypes (the interpreter takes minutes for all three)
_DTYPES = tuple(
    getattr(torch, name)
    for name in os.environ.get("XHAL_FUSED_TEST_DTYPES", "float32,bfloat16,float16").split(",")
)


class FusedInterpretedPlatform(CpuPlatform):
    name = "cuda-fused-interpreted"
    capabilities = dataclasses.replace(
        CpuPlatform.capabilities,
        graphs=False,
        attention=dataclasses.replace(
            CpuPlatform.capabilities.attention,
            dtypes=_DTYPES,
            head_dims=(64,),  # the smaller of the CUDA platform's two: the interpreter is slow
            # decode only: an interpreted prefill takes half a minute (the GPU run covers it)
            batch_kinds=frozenset({BatchKind.DECODE}),
            any_head_dim=False,
        ),
        ops_dtypes=_DTYPES,
        notes=("xhal.platforms.cuda's fused decode kernels in Triton's interpreter (tests only)",),
    )

    def __init__(self) -> None:
        super().__init__()
        self._ops = FusedInterpretedOps()

    def attention_backend(self, spec: AttentionSpec):
        from xhal.platforms.cuda.splitkv_attention import with_splitkv_decode
        from xhal.platforms.cuda.triton_attention import TritonAttention

        self.capabilities.attention.check(spec)
        # as the CUDA platform's Triton solution composes it: decode steps on the split-KV
        # kernel (a few "SMs", so that longer contexts split), the rest on the paged kernel
        return with_splitkv_decode(spec, TritonAttention(spec), num_sms=4)


platforms.register("cuda-fused-interpreted", FusedInterpretedPlatform)
