"""The ``native`` solution of ``linear_add_rms_norm_moe_route``: a MoE layer's o projection and
router in one launch (``kernels/gemv_stream.cu``'s route entry), in a provider of its own so that
``CudaOps`` keeps the op's default, the plain sequence on the platform's chosen ops."""

from __future__ import annotations

from xhal import env
from xhal.platforms.cuda import pdl
from xhal.platforms.cuda.kernels import gemv_stream
from xhal.platforms.cuda.ops import CudaOps


class NativeORouteOps(CudaOps):
    """CudaOps whose ``linear_add_rms_norm_moe_route`` runs ``gemv_stream.cu``'s route entry
    where it can (the op's ``native`` solution; CudaOps itself keeps the op's default, the plain
    sequence on the platform's chosen ops)."""

    def linear_add_rms_norm_moe_route(
        self, x, weight, residual, norm_weight, eps, gate_weight, top_k, renormalize
    ):
        """One launch for a decode row in a graph on sm_90+ (``gemv_stream.cu``'s route entry:
        the o projection streamed as the stream GEMV streams it, each CTA adding its rows' share
        of the router's logits and of the norm, the last CTA routing), taking half an SM and
        letting the next kernel launch before its wait as o does with ``o`` in
        ``env.cuda_overlap``. Otherwise the o projection and ``add_rms_norm_moe_route`` apart
        (two launches at batch 1)."""
        if (
            self.fused
            and env.cuda_native_gemv()
            and gemv_stream.supports_route(x, weight, residual, norm_weight, gate_weight, top_k)
        ):
            kernels = self._native(x.device, gemv_stream.GemvStream)
            beside = "o" in env.cuda_overlap() and gemv_stream.fits_beside(x)
            use_pdl = bool(pdl.mode(x.device))
            key = (
                "stream_route", *x.shape, *weight.shape, gate_weight.shape[0], top_k,
                renormalize, x.dtype, x.device, use_pdl, beside,
            )  # fmt: skip
            if kernels is not None and self._graph_kernel(key):
                routed = kernels.route(
                    x, weight, residual, norm_weight, eps, gate_weight, top_k, renormalize,
                    use_pdl, beside,
                )  # fmt: skip
                if routed is not None:
                    return routed
        return super().linear_add_rms_norm_moe_route(
            x, weight, residual, norm_weight, eps, gate_weight, top_k, renormalize
        )
