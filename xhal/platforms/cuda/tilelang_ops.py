"""DeviceOps of ``cuda-tilelang``: TileLang's fused add+RMSNorm, the CUDA ops for the rest."""

from __future__ import annotations

from xhal.platforms.cuda.ops import CudaOps


class TileLangOps(CudaOps):
    """``fused_add_rms_norm`` on TileLang (solution ``tilelang``: fp16 / bf16 / fp32, weight in the
    input's dtype, hidden size a multiple of 256 up to 16384); other shapes and every other op on
    the Triton / torch solutions of ``CudaOps``."""

    def fused_add_rms_norm(self, x, residual, weight, eps):
        from xhal.platforms.cuda.kernels import tilelang_norm

        if x.numel() and tilelang_norm.supports(x, weight):
            return tilelang_norm.fused_add_rms_norm(x, residual, weight, eps)
        return super().fused_add_rms_norm(x, residual, weight, eps)
