"""TEST-ONLY plugin: the CUDA platform's FlashInfer attention (``xhal.platforms.cuda.attention``) on
the FlashInfer emulation, everything else the CPU reference.

``XHAL_PLUGINS=tests.support.flashinfer_emulation.plugin`` (or ``xhal-conformance --plugin
tests.support.flashinfer_emulation.plugin``) registers "flashinfer-emulated". Its attention backend
is
``FlashInferAttention`` unchanged but for the KV write (the reference's, which the CPU graph
runner records as one call, where it cannot record an interpreted Triton kernel). The emulation is
installed when the platform is created, not when this module is imported.
"""

from __future__ import annotations

import dataclasses

import torch

from xhal import platforms
from xhal.interfaces.attention import AttentionSpec
from xhal.platforms.cpu_ref.kernels import kv_write, paged_attention  # noqa: F401  (register torch.ops.xhal_cpu_ref)
from xhal.platforms.cpu_ref.platform import CpuPlatform

_WORKSPACE_BYTES = 1024 * 1024  # the emulated kernels never touch it; FlashInfer wants one


class EmulatedFlashInferPlatform(CpuPlatform):
    name = "flashinfer-emulated"
    capabilities = dataclasses.replace(
        CpuPlatform.capabilities,
        attention=dataclasses.replace(
            CpuPlatform.capabilities.attention,
            dtypes=(torch.bfloat16, torch.float16),  # FlashInfer's
            head_dims=(64, 128),  # the CUDA platform's declaration, not the reference's "any"
            any_head_dim=False,
        ),
        ops_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        notes=(
            "xhal.platforms.cuda's FlashInferAttention on a CPU emulation of FlashInfer 0.5.3 "
            "(tests only)",
        ),
    )

    def __init__(self, use_tensor_cores: bool | None = None) -> None:
        """``use_tensor_cores``: as ``FlashInferAttention`` takes it (None: FlashInfer's advice)."""
        from . import install  # the package this plugin was imported from (one copy per process)

        install()
        super().__init__()
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8)
        self._use_tensor_cores = use_tensor_cores

    def attention_backend(self, spec: AttentionSpec):
        from xhal.platforms.cuda.attention import FlashInferAttention

        self.capabilities.attention.check(spec)
        return FlashInferAttention(
            spec, self._workspace, self._use_tensor_cores, kv_write=torch.ops.xhal_cpu_ref.write_kv
        )


platforms.register("flashinfer-emulated", EmulatedFlashInferPlatform)
