"""TEST-ONLY plugin: "cuda-triton-interpreted", the CUDA platform's Triton attention
(``TritonAttention``: our KV-write and paged-attention kernels, decode steps on the split-KV
kernel) run by Triton's interpreter on CPU tensors; everything else is the CPU reference.

``xhal-conformance --device cuda-triton-interpreted --plugin
tests.support.triton_interpreted_platform`` proves the fallback's eager attention on any CPU. Graphs
are declared off: the CPU graph runner records torch ops, and an interpreted kernel is not one (the
graph family runs on the GPU).
"""

from __future__ import annotations

import dataclasses
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from xhal import platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.platforms.cpu_ref.platform import CpuPlatform


class InterpretedTritonPlatform(CpuPlatform):
    name = "cuda-triton-interpreted"
    capabilities = dataclasses.replace(
        CpuPlatform.capabilities,
        graphs=False,
        attention=dataclasses.replace(
            CpuPlatform.capabilities.attention,
            dtypes=(torch.float32, torch.bfloat16, torch.float16),
            head_dims=(64, 128),  # the CUDA platform's declaration, not the reference's "any"
            any_head_dim=False,
        ),
        ops_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        notes=("xhal.platforms.cuda's Triton attention in Triton's interpreter (tests only)",),
    )

    def attention_backend(self, spec: AttentionSpec):
        from xhal.platforms.cuda.splitkv_attention import with_splitkv_decode
        from xhal.platforms.cuda.triton_attention import TritonAttention

        self.capabilities.attention.check(spec)
        # as the CUDA platform's Triton solution composes it: decode steps on the split-KV
        # kernel (a few "SMs", so that longer contexts split), the rest on the paged kernel
        return with_splitkv_decode(spec, TritonAttention(spec), num_sms=4)


platforms.register("cuda-triton-interpreted", InterpretedTritonPlatform)
