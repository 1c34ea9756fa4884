"""CUDA DeviceOps: our Triton kernels for small-batch linear layers (GEMV, and fused with the
RMSNorm or SiLU gate before them), the fused residual add + RMSNorm, rotary embedding and gated
activations (out of place, one launch each), the fused mixture of experts
(top-k routing, grouped GEMMs over expert-sorted tokens), FlashInfer's RMSNorm /
activation kernels when FlashInfer is present, vectorized torch otherwise; sampling without host
syncs. On sm_90+ a decode row's MLP block, norm + qkv and LM head run native CUDA kernels that
stream weights by TMA bulk copies (``native.py``, ``kernels/mlp_block.cu``,
``kernels/gemv_stream.cu``)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from xhal import env
from xhal.interfaces.ops import DeviceOps
from xhal.platforms.common import sampling
from xhal.platforms.cuda import native, pdl, skinny_choice
from xhal.platforms.cuda.kernels import (
    activation,
    fused_gemv,
    gemv,
    gemv_stream,
    mlp_block,
    moe,
    moe_block,
    moe_route,
    moe_router,
    norm,
    qk_norm,
    rotary,
    skinny_mma,
)

logger = logging.getLogger(__name__)


class CudaOps(DeviceOps):
    """Triton where a decode step spends its launches and weight bandwidth (small-M linear, the
    two ops that run twice per layer); vectorized torch for the rest (no per-row loops, no host
    syncs: the CPU reference loops; this must not)."""

    # rows up to which our GEMV beats cuBLAS (benchmarks/bench_gemv.py on the H200); the
    # environment variable raises it to measure the tensor-core path (17-64 rows) in a model step
    gemv_max_rows = 1

    def __init__(self, native_moe_block: bool = False) -> None:
        """``native_moe_block``: ``moe_experts`` takes the persistent expert block where it can
        (the ``native`` solution of ``moe_experts``; measured slower than the Triton pair GEMVs,
        so not the default)."""
        self.native_moe_block = native_moe_block
        self._gemv_loaded: set[tuple] = set()
        self._natives: dict[tuple, object] = {}  # (family, device) -> its launcher
        self._native_missing_logged = False
        self._skinny_refused: set[tuple] = set()  # shapes whose skinny GEMM failed to launch
        self._skinny_chosen: dict[tuple, object] = {}  # shape -> its launch shape, None: cuBLAS
        # a device's skinny choice, made on its first use (the cache is keyed by the device)
        self._skinny_choices: dict[torch.device, skinny_choice.SkinnyChoice] = {}
        self.fused = env.cuda_fused()
        rows = env.cuda_gemv_max_rows(gemv.MAX_M)
        if rows is not None:
            self.gemv_max_rows = rows

    def linear(self, x, weight, bias=None):
        """Our GEMV for one-row linears captured into a CUDA graph, cuBLAS otherwise. A Triton
        launch from Python costs the host far more than cuBLAS's (on the H200 host an eager
        batch-1 8B step took 49 ms with it in every linear, 17 ms in an earlier run without),
        while a graph replays it for free. Compiling and loading a kernel cannot happen under
        capture, so the first eager call of a shape (the graph runner's warm-up) launches our
        kernel once and later captures of that shape use it. With PDL on (pdl.py) the GEMV is
        the stream kernel, which waits for its input after loading its first weight tile. On
        sm_90+ with NVRTC, the native stream GEMV (``gemv_stream.cu``) before both."""
        out = self._stream_gemv(x, weight, bias)
        if out is not None:
            return out[0]
        out = self._skinny_mma(x, weight, bias)
        if out is not None:
            return out
        use_pdl = pdl.mode(x.device)
        key = (
            "linear", x.shape[0], *weight.shape, x.stride(), x.dtype, x.device, bias is not None,
            use_pdl,
        )
        if (
            x.dim() == 2 and x.shape[0] <= self.gemv_max_rows and gemv.supports_gemv(x, weight)
            and self._graph_kernel(key)
        ):
            if x.shape[0] <= gemv.MAX_CORE_M and (
                use_pdl or (x.shape[0] == 1 and (0, *weight.shape) in fused_gemv.TUNED)
            ):
                return fused_gemv.stream_gemv(x, weight, bias, use_pdl=use_pdl)
            return gemv.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def _graph_kernel(self, key: tuple) -> bool:
        """Whether this call launches one of our kernels (Triton's, or native ones: their keys
        start with the launcher's name): under capture, when an eager call of the same key
        compiled it; eagerly, only the first call of a key (the warm-up), since eager launches
        of ours cost the host more than the library call they replace."""
        if torch.cuda.is_current_stream_capturing():
            return key in self._gemv_loaded
        if key in self._gemv_loaded:
            return False
        self._gemv_loaded.add(key)
        return True

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        """One fused kernel for one-row decode in a graph (the native stream GEMV with its norm
        prologue on sm_90+ with NVRTC, else fused_gemv.add_rms_norm_gemv); the unfused sequence
        otherwise (or with XHAL_CUDA_FUSED=0)."""
        if self.fused:
            out = self._stream_gemv(x, weight, bias, residual, norm_weight, eps)
            if out is not None:
                return out
        use_pdl = pdl.mode(x.device)
        if (
            self.fused
            and x.dim() == 2
            and x.shape[0] <= self.gemv_max_rows
            and fused_gemv.supports(x, weight)
            and residual.shape == x.shape
            and self._graph_kernel(
                (
                    "norm_linear",
                    x.shape[0],
                    *weight.shape,
                    x.stride(),
                    residual.stride(),
                    x.dtype,
                    x.device,
                    bias is not None,
                    use_pdl,
                )
            )
        ):
            return fused_gemv.add_rms_norm_gemv(
                x, residual, norm_weight, eps, weight, bias, use_pdl=use_pdl
            )
        return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_and_mul_linear(self, x, weight, bias=None):
        """One fused kernel (fused_gemv.silu_and_mul_gemv) for one-row decode in a graph; the
        unfused sequence otherwise (or with XHAL_CUDA_FUSED=0)."""
        use_pdl = pdl.mode(x.device)
        if (
            self.fused
            and x.dim() == 2
            and x.shape[0] <= self.gemv_max_rows
            and fused_gemv.supports(x, weight, gated=True)
            and self._graph_kernel(
                (
                    "silu_linear",
                    x.shape[0],
                    *weight.shape,
                    x.stride(),
                    x.dtype,
                    x.device,
                    bias is not None,
                    use_pdl,
                )
            )
        ):
            return fused_gemv.silu_and_mul_gemv(x, weight, bias, use_pdl=use_pdl)
        return super().silu_and_mul_linear(x, weight, bias)

    def add_rms_norm_gated_mlp(
        self, x, residual, norm_weight, eps, gate_up_weight, down_weight, gate_up_bias=None,
        down_bias=None,
    ):  # fmt: skip
        """The persistent MLP block (``kernels/mlp_block.cu``: one launch, weights through TMA
        bulk copies, one grid barrier) for one fp16 / bf16 row in a graph on sm_90+ (its
        ``ROUTED_ROWS``); the two fused ops otherwise, or with ``XHAL_CUDA_MLP_BLOCK=0``."""
        if (
            self.fused
            and gate_up_bias is None
            and down_bias is None
            and x.dim() == 2
            and x.shape[0] <= mlp_block.ROUTED_ROWS
            and env.cuda_mlp_block()
            and mlp_block.supports(x, residual, norm_weight, gate_up_weight, down_weight)
        ):
            beside = "mlp" in env.cuda_overlap() and mlp_block.fits_beside(x, down_weight)
            block = self._native(x.device, mlp_block.MlpBlock)
            use_pdl = bool(pdl.mode(x.device))
            key = ("mlp_block", *x.shape, down_weight.shape[1], x.dtype, x.device, use_pdl,
                   beside)  # fmt: skip
            if block is not None and self._graph_kernel(key):
                return block(
                    x, residual, norm_weight, eps, gate_up_weight, down_weight, use_pdl, beside
                )
        return super().add_rms_norm_gated_mlp(
            x, residual, norm_weight, eps, gate_up_weight, down_weight, gate_up_bias, down_bias
        )

    def _stream_gemv(self, x, weight, bias, residual=None, norm_weight=None, eps=0.0):
        """``gemv_stream.cu`` (a one-row GEMV, its weights through TMA bulk copies, the first
        stages requested before the PDL wait) when it takes the call, else None. The norm form
        when given the residual and norm weight. Plain GEMVs come here from ``MIN_PLAIN_BYTES``
        (LM heads), and with ``o`` in ``env.cuda_overlap`` all of them; a layer's projection
        (under ``MIN_PLAIN_BYTES``) named there takes half an SM, and a plain one lets the next
        kernel launch before its wait."""
        if not (
            bias is None
            and x.dim() == 2
            and x.shape[0] <= gemv_stream.ROUTED_ROWS
            and env.cuda_native_gemv()
            and gemv_stream.supports(x, weight, residual, norm_weight)
        ):
            return None
        layer = weight.numel() * 2 < gemv_stream.MIN_PLAIN_BYTES
        beside = (
            layer
            and ("o" if residual is None else "qkv") in env.cuda_overlap()
            and gemv_stream.fits_beside(x)
        )
        if residual is None and layer and not beside:  # stays on Triton's GEMV
            return None
        kernels = self._native(x.device, gemv_stream.GemvStream)
        use_pdl = bool(pdl.mode(x.device))
        early = beside and residual is None
        key = (
            "stream_gemv", *x.shape, weight.shape[0], x.dtype, x.device, residual is not None,
            use_pdl, beside,
        )  # fmt: skip
        if kernels is None or not self._graph_kernel(key):
            return None
        return kernels(x, weight, use_pdl, residual, norm_weight, eps, beside, early)

    def _skinny_mma(self, x, weight, bias):
        """``skinny_mma.cu`` (2 to 64 rows on the tensor cores, K split over a cluster) where it
        takes the call and ``env.cuda_skinny_mma`` says so (``auto``: where a timing on this
        machine found it faster than cuBLAS, ``skinny_choice.py``), else None."""
        mode = env.cuda_skinny_mma()
        if not (
            mode != "off"
            and bias is None
            and x.dim() == 2
            and self.gemv_max_rows < x.shape[0] <= skinny_mma.MAX_ROWS
            and skinny_mma.supports(x, weight)
        ):
            return None
        kernels = self._native(x.device, skinny_mma.SkinnyMma)
        use_pdl = bool(pdl.mode(x.device))
        key = ("skinny_mma", *x.shape, x.stride(0), weight.shape[0], x.dtype, x.device, use_pdl)
        if kernels is None or key in self._skinny_refused:
            return None
        capturing = torch.cuda.is_current_stream_capturing()
        try:
            if mode == "auto":
                shape = self._skinny_shape(key, kernels, x, weight, use_pdl, capturing)
            else:
                shape = kernels.plan(x.shape[0], weight.shape[0], x.shape[1])
            if shape is None or not self._graph_kernel(key):
                return None
            return kernels(x, weight, use_pdl, shape)
        except RuntimeError as e:  # a build or launch the driver refuses (the first, eager call)
            if capturing:
                raise
            self._skinny_refused.add(key)
            logger.warning("cuda: skinny GEMM off for %s x %s: %s", tuple(x.shape), weight.shape, e)
            return None

    def _skinny_shape(self, key, kernels, x, weight, use_pdl, capturing):
        """The launch shape ``auto`` gives this call, or None for cuBLAS: the choice of its shape
        (``skinny_choice.py``), made by the first eager call (the graph warm-up) of a row count
        in ``skinny_choice.TIMED_ROWS``; a capture before it, and other row counts, take
        cuBLAS."""
        if key in self._skinny_chosen:
            return self._skinny_chosen[key]
        if capturing or x.shape[0] not in skinny_choice.TIMED_ROWS:
            return None
        choice = self._skinny_choices.get(x.device)
        if choice is None:
            from xhal.platforms.cuda.platform import device_info
            from xhal.solutions.tuning_cache import TuningCache

            choice = skinny_choice.SkinnyChoice(TuningCache(device_info(x.device.index)))
            self._skinny_choices[x.device] = choice
        (m, k), n = x.shape, weight.shape[0]
        shapes = {p.label: p for p in kernels.choices(m, n, k)}
        if not shapes:  # no launch shape runs in one wave on this device
            self._skinny_chosen[key] = None
            return None
        winner = choice.choose(
            skinny_choice.bucket(m, n, k, x.dtype),
            {label: (lambda w, p=p: kernels(x, w, use_pdl, p)) for label, p in shapes.items()},
            lambda w: F.linear(x, w),
            weight,
        )
        self._skinny_chosen[key] = shapes.get(winner)
        return self._skinny_chosen[key]

    def _native(self, device: torch.device, family):
        """The device's launcher of a native kernel family (``family(device)``), made on the first
        eager call; None without NVRTC or nvcc (one log line) or under capture before that."""
        key = (family, device)
        if key not in self._natives:
            if native.unavailable() is not None:
                if not self._native_missing_logged:
                    self._native_missing_logged = True
                    logger.warning("cuda: native kernels off: %s", native.unavailable())
                return None
            if torch.cuda.is_current_stream_capturing():
                return None
            self._natives[key] = family(device)
        return self._natives[key]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """One Triton launch (kernels/activation.py) for every fp16 / bf16 / fp32 shape: also what
        ``silu_and_mul_linear`` runs before cuBLAS at 2+ rows. ``XHAL_CUDA_TRITON_ACTIVATION=0``
        (read per call, so a graph keeps the setting it was captured with) runs the torch
        sequence, the peer a benchmark times it against."""
        if env.cuda_triton_activation() and activation.supports(x):
            return activation.silu_and_mul(x)
        return super().silu_and_mul(x)

    def gelu_and_mul(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        if env.cuda_triton_activation() and activation.supports(x):
            return activation.gelu_and_mul(x, approximate)
        return super().gelu_and_mul(x, approximate)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(
            x.dtype
        )

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return norm.fused_add_rms_norm(x, residual, weight, eps)

    def qk_rms_norm(self, q, k, q_weight, k_weight, eps):
        """One launch for both norms (Qwen3's q_norm and k_norm), any number of tokens; the two
        norms with XHAL_CUDA_FUSED=0."""
        if self.fused and qk_norm.supports(q, k, q_weight):
            return qk_norm.qk_rms_norm(q, k, q_weight, k_weight, eps)
        return super().qk_rms_norm(q, k, q_weight, k_weight, eps)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, is_neox):
        return rotary.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)

    def moe_route(self, router_logits, top_k, renormalize):
        return moe_route.route(router_logits, top_k, renormalize)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids):
        """The Triton fused MoE (moe_small's pair GEMVs for a few tokens, grouped GEMMs beyond);
        with ``native_moe_block`` (the ``native`` solution), one token's experts in one
        persistent launch in a graph on sm_90+ (``kernels/moe_block.cu``)."""
        if (
            self.native_moe_block
            and self.fused
            and moe_block.supports(x, w13, w2, topk_weights, topk_ids)
        ):
            block = self._native(x.device, moe_block.MoeBlock)
            use_pdl = bool(pdl.mode(x.device))
            key = ("moe_block", *w13.shape, topk_ids.shape[1], x.dtype, x.device, use_pdl)
            if block is not None and self._graph_kernel(key):
                return block(x, w13, w2, topk_weights, topk_ids, use_pdl)
        return moe.fused_experts(x, w13, w2, topk_weights, topk_ids)

    def add_rms_norm_moe_route(
        self, x, residual, norm_weight, eps, gate_weight, top_k, renormalize
    ):
        """One launch (moe_router.add_rms_norm_route) for decode batches of up to 16 tokens, the
        unfused sequence otherwise (or with XHAL_CUDA_FUSED=0). It replaces three Triton
        launches and cuBLAS's, so it runs eagerly too, unlike the fused GEMVs."""
        if self.fused and moe_router.supports(x, residual, gate_weight):
            return moe_router.add_rms_norm_route(
                x, residual, norm_weight, eps, gate_weight, top_k, renormalize
            )
        return super().add_rms_norm_moe_route(
            x, residual, norm_weight, eps, gate_weight, top_k, renormalize
        )

    def sample(self, logits, temperature, top_k, top_p, generator=None):
        return sampling.sample(logits, temperature, top_k, top_p, generator)


class FlashInferOps(CudaOps):
    """FlashInfer's fused kernels where their semantics match ours exactly (out of place)."""

    def __init__(self) -> None:
        import flashinfer

        super().__init__()
        self._fi = flashinfer

    def rms_norm(self, x, weight, eps):
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().rms_norm(x, weight, eps)
        return self._fi.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    @staticmethod
    def _fi_activation_fits(x: torch.Tensor) -> bool:
        """FlashInfer's activations take fp16 / bf16 halves of a whole number of 16-byte vectors
        from a 16-byte aligned, contiguous input."""
        half_bytes = x.shape[-1] // 2 * x.element_size()
        return (
            x.dtype in (torch.float16, torch.bfloat16)
            and x.is_contiguous()
            and half_bytes % 16 == 0
            and x.data_ptr() % 16 == 0
        )

    def silu_and_mul(self, x):
        if not self._fi_activation_fits(x):
            return super().silu_and_mul(x)
        return self._fi.silu_and_mul(x)

    def gelu_and_mul(self, x, approximate="none"):
        # FlashInfer 0.5.3's gelu_tanh_and_mul is 1.6 ulp off in fp16 (conformance ops family on
        # the H200, shape (7, 192)): the tanh form takes ours, float32 rounded once
        if approximate == "tanh" or not self._fi_activation_fits(x):
            return super().gelu_and_mul(x, approximate)
        return self._fi.gelu_and_mul(x)
