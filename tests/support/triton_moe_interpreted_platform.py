"""TEST-ONLY plugin: "cuda-moe-interpreted", the CUDA platform's Triton mixture of experts
(``xhal.platforms.cuda.kernels``: the routing kernel of ``moe_route``, expert-sorted pairs and
grouped GEMMs of ``moe``; the fused norm and router of ``moe_router``) run by
Triton's interpreter on CPU tensors; everything else is the CPU reference.

``xhal-conformance --device cuda-moe-interpreted --plugin
tests.support.triton_moe_interpreted_platform --family moe`` proves the kernels on any CPU, graphs
included: each MoE op is one ``xhal`` custom op, which the CPU graph runner records and re-runs on
replay like a device graph's kernel. There
``fused_experts`` picks its path by shape as on the GPU (the one-token case takes the pair GEMVs);
"cuda-moe-small-interpreted" forces the pair GEMVs (``moe_small``) onto every case of up to 64
tokens (the graphs included).
Only float32 is declared: Triton 3.6's interpreter runs ``tl.dot`` on bfloat16's raw bits (the
H200 run checks it compiled), and float16 is covered by tests/platforms/cuda/test_triton_moe.py's
direct cases (interpreted kernels are slow; one dtype keeps this run near half a minute).
"""

from __future__ import annotations

import dataclasses
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from xhal import platforms
from xhal.platforms.cpu_ref.ops import CpuOps
from xhal.platforms.cpu_ref.platform import CpuPlatform


class _TritonMoeOps(CpuOps):
    def moe_route(self, router_logits, top_k, renormalize):
        from xhal.platforms.cuda.kernels import moe_route

        return moe_route.route(router_logits, top_k, renormalize)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        from xhal.platforms.cuda.kernels import moe

        return moe.fused_experts(x, w13, w2, topk_weights, topk_ids)


    def add_rms_norm_moe_route(
        self, x, residual, norm_weight, eps, gate_weight, top_k, renormalize
    ):
        from xhal.platforms.cuda.kernels import moe_router

        if not moe_router.supports(x, residual, gate_weight):
            return super().add_rms_norm_moe_route(
                x, residual, norm_weight, eps, gate_weight, top_k, renormalize
            )
        return moe_router.add_rms_norm_route(
            x, residual, norm_weight, eps, gate_weight, top_k, renormalize
        )


class _TritonSmallMoeOps(_TritonMoeOps):
    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        from xhal.platforms.cuda.kernels import moe, moe_small

        # the family's two cases of 77 and 130 tokens keep the grouped GEMMs: interpreted, the
        # pair GEMVs of that many pairs take a minute (test_triton_moe checks crowded experts)
        small = moe_small.SmallMoeConfig() if x.shape[0] <= 64 else None
        return moe.fused_experts(x, w13, w2, topk_weights, topk_ids, small)


class InterpretedTritonMoePlatform(CpuPlatform):
    name = "cuda-moe-interpreted"
    capabilities = dataclasses.replace(
        CpuPlatform.capabilities,
        ops_dtypes=(torch.float32,),
        notes=(
            "xhal.platforms.cuda's Triton mixture of experts in Triton's interpreter (tests only)",
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._ops = _TritonMoeOps()


platforms.register("cuda-moe-interpreted", InterpretedTritonMoePlatform)


class InterpretedTritonSmallMoePlatform(InterpretedTritonMoePlatform):
    name = "cuda-moe-small-interpreted"

    def __init__(self) -> None:
        super().__init__()
        self._ops = _TritonSmallMoeOps()


platforms.register("cuda-moe-small-interpreted", InterpretedTritonSmallMoePlatform)
