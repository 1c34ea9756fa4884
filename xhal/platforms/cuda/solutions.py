"""The CUDA platform's solutions. Priorities keep the choices made before solutions existed:
FlashInfer's norm and activations and attention when installed, our Triton GEMV / fused add+norm
/ rotary / fused MoE, cuBLAS and torch as the fallbacks; since: our Triton gated activations
ahead of FlashInfer's (bench_activation on the H200, silu_and_mul bf16 at 1 / 16 / 64 rows of the
8B shape: 1.09 / 1.32 / 2.89 us against 3.58 / 3.61 / 4.36; 1B: 1.08 / 1.18 / 2.31 against 1.76 /
1.84 / 2.45; docs/h200-results.md, tenth session), and inside FlashInfer's where it cannot run;
the native persistent MLP block ahead of the Triton GEMV pair (Llama-3.2-1B batch-1 step 0.898
against 0.969 ms, 8B 4.17 against 4.32, with the native stream GEMV; fourteenth session)."""

from __future__ import annotations

import torch

from xhal.solutions.solution import Config, Package, Requirement, Solution

TRITON = Package("triton", "pip install 'xhal[cuda]' (triton)")
FLASHINFER = Package("flashinfer", "pip install 'xhal[cuda]' (flashinfer-python==0.5.3)")
TILELANG = Package(
    "tilelang",
    "pip install tilelang==0.1.15 (with z3-solver, apache-tvm-ffi 0.1.12, ml-dtypes, "
    "torch-c-dlpack-ext;"
    " scripts/fetch_tilelang_wheels.sh for a machine without network)",
)
_HALF = (torch.float16, torch.bfloat16)


def _req(*packages: Package, dtypes: tuple[torch.dtype, ...] | None = None) -> Requirement:
    return Requirement(device_type="cuda", dtypes=dtypes, packages=packages)


# the config space of linear=triton-tuned (xhal/platforms/cuda/tuned_gemv.py), spelled here so that
# the declaration imports nothing
_GEMV_CONFIGS = (
    Config("heuristic", {}),
    Config("wide-rows", {"block_n_scale": 2}),
    Config("split-k-x2", {"split_scale": 2.0}),
    Config("split-k-half", {"split_scale": 0.5}),
)
_OPS = "xhal.platforms.cuda.providers:cuda_ops"
_FI_OPS = "xhal.platforms.cuda.providers:flashinfer_ops"
_TORCH = "xhal.platforms.common.torch_ops:TorchOps"

SOLUTIONS = (
    Solution(
        "linear",
        "triton",
        _OPS,
        _req(TRITON),
        20,
        description=(
            "our GEMV for one-row linears (XHAL_CUDA_GEMV_MAX_ROWS; the native stream GEMV for "
            "LM-head-sized weights on sm_90+); 2-64 rows on the skinny GEMM where a timing found "
            "it faster (sm_90+), cuBLAS beyond"
        ),
        times_itself=True,  # the skinny GEMM against cuBLAS (skinny_choice.py)
    ),
    Solution(
        "linear",
        "triton-tuned",
        "xhal.platforms.cuda.tuned_gemv:TunedGemv",
        _req(TRITON),
        15,
        configs=_GEMV_CONFIGS,
        bucket="xhal.platforms.cuda.tuned_gemv:bucket",
        description="our GEMV for up to 64 rows, its launch shape autotuned; cuBLAS beyond",
    ),
    Solution("linear", "vendor", _TORCH, _req(), 10, description="cuBLAS for every shape"),
    Solution(
        "rms_norm",
        "flashinfer",
        _FI_OPS,
        _req(FLASHINFER),
        20,
        description="FlashInfer's rmsnorm for fp16/bf16, float32 on torch",
    ),
    Solution("rms_norm", "torch", _TORCH, _req(), 10),
    Solution("fused_add_rms_norm", "triton", _OPS, _req(TRITON), 20),
    Solution(
        "fused_add_rms_norm",
        "tilelang",
        "xhal.platforms.cuda.providers:tilelang_ops",
        _req(TILELANG),
        15,
        description="TileLang's for hidden sizes a multiple of 256, Triton otherwise",
    ),
    Solution("fused_add_rms_norm", "torch", _TORCH, _req(), 10),
    Solution("rotary_embedding", "triton", _OPS, _req(TRITON), 20),
    Solution(
        "silu_and_mul",
        "flashinfer",
        _FI_OPS,
        _req(FLASHINFER),
        20,
        description="FlashInfer's for aligned fp16/bf16, ours (triton) otherwise",
    ),
    Solution(
        "silu_and_mul",
        "triton",
        _OPS,
        _req(TRITON),
        25,
        description="one launch for every fp16/bf16/fp32 shape (kernels/activation.py)",
    ),
    Solution("silu_and_mul", "torch", _TORCH, _req(), 10),
    Solution(
        "gelu_and_mul",
        "flashinfer",
        _FI_OPS,
        _req(FLASHINFER),
        20,
        description="FlashInfer's exact-erf form for aligned fp16/bf16, ours (triton) otherwise",
    ),
    Solution(
        "gelu_and_mul",
        "triton",
        _OPS,
        _req(TRITON),
        25,
        description="erf and tanh forms, one launch for every fp16/bf16/fp32 shape",
    ),
    Solution("gelu_and_mul", "torch", _TORCH, _req(), 10),
    # the fused decode ops: our fused GEMVs for a graph-captured row (XHAL_CUDA_FUSED=0: the
    # unfused sequence of the chosen ops), the unfused sequence elsewhere
    Solution(
        "add_rms_norm_linear",
        "triton",
        _OPS,
        _req(TRITON),
        20,
        description=(
            "residual add + RMSNorm in the GEMV's prologue for one row (the native stream GEMV "
            "on sm_90+, Triton's otherwise)"
        ),
    ),
    Solution(
        "silu_and_mul_linear",
        "triton",
        _OPS,
        _req(TRITON),
        20,
        description="the SiLU gate in the down GEMV's prologue for one row",
    ),
    Solution(
        "add_rms_norm_gated_mlp",
        "native",
        _OPS,
        Requirement(device_type="cuda", min_compute_capability=(9, 0), packages=(TRITON,)),
        30,
        description=(
            "one persistent launch (TMA weight stream, one grid barrier; kernels/mlp_block.cu, "
            "built by NVRTC) for 1-4 fp16/bf16 rows in a graph; the Triton pair otherwise"
        ),
    ),
    Solution(
        "add_rms_norm_gated_mlp",
        "triton",
        "xhal.platforms.cuda.providers:TritonMlpPair",
        _req(TRITON),
        20,
        description="the fused GEMV pair: norm + gate_up, then the SiLU gate + down",
    ),
    Solution(
        "qk_rms_norm",
        "triton",
        _OPS,
        _req(TRITON),
        20,
        description="q's and k's per-head RMSNorm (Qwen3) in one launch",
    ),
    Solution("moe_route", "triton", _OPS, _req(TRITON), 20),
    Solution(
        "add_rms_norm_moe_route",
        "triton",
        _OPS,
        _req(TRITON),
        20,
        description="add + RMSNorm, router GEMV and top-k in one launch for up to 16 tokens",
    ),
    # CudaOps inherits the op's default: the chosen linear (o), then the chosen
    # add_rms_norm_moe_route (one Triton launch for up to 16 rows)
    Solution(
        "linear_add_rms_norm_moe_route",
        "unfused",
        _OPS,
        _req(),
        20,
        description="the chosen linear for o, then the chosen add_rms_norm_moe_route",
    ),
    # below unfused: in the one decode step measured (an H100, before a fix to its last CTA's
    # loads) it was slower; XHAL_KERNEL_LINEAR_ADD_RMS_NORM_MOE_ROUTE=native picks it
    Solution(
        "linear_add_rms_norm_moe_route",
        "native",
        "xhal.platforms.cuda.providers:native_o_route_ops",
        Requirement(device_type="cuda", min_compute_capability=(9, 0), packages=(TRITON,)),
        18,
        description=(
            "o projection + add + RMSNorm + router + top-k in one launch for one fp16/bf16 row "
            "in a graph (kernels/gemv_stream.cu's route entry, built by NVRTC); the o GEMV and "
            "the fused router otherwise"
        ),
    ),
    Solution(
        "moe_experts",
        "triton",
        _OPS,
        _req(TRITON),
        20,
        description="grouped GEMMs; the pair GEMVs of moe_small for a few tokens",
    ),
    # below triton: it conforms but measured slower on an H100 (Qwen3-30B-A3B shape, batch 1:
    # router + experts 36.5 against 35.1 us a layer, decode step 3.47 against 3.41 ms;
    # docs/h200-results.md, seventeenth session). XHAL_KERNEL_MOE_EXPERTS=native picks it
    Solution(
        "moe_experts",
        "native",
        "xhal.platforms.cuda.providers:native_moe_ops",
        Requirement(device_type="cuda", min_compute_capability=(9, 0), packages=(TRITON,)),
        18,
        description=(
            "one persistent launch for one fp16/bf16 token in a graph (TMA expert stream, one "
            "grid barrier; kernels/moe_block.cu, built by NVRTC); the triton solution otherwise"
        ),
    ),
    Solution(
        "moe_experts",
        "triton-grouped",
        "xhal.platforms.cuda.providers:GroupedMoe",
        _req(TRITON),
        15,
        description="grouped GEMMs for every batch",
    ),
    Solution("sampling", "torch", _TORCH, _req(), 10),
    *(
        Solution(op, name, target, req, priority)
        for op in ("paged_decode_attention", "paged_prefill_attention")
        for name, target, req, priority in (
            (
                "flashinfer",
                "xhal.platforms.cuda.providers:FlashInferAttentionProvider",
                _req(FLASHINFER, dtypes=_HALF),
                30,
            ),
            ("triton", "xhal.platforms.cuda.providers:TritonAttentionProvider", _req(TRITON), 20),
        )
    ),
    # decode only: prefill steps stay on FlashInfer (paged_prefill_attention=flashinfer);
    # XHAL_KERNEL_PAGED_DECODE_ATTENTION=flashinfer turns it off
    Solution(
        "paged_decode_attention",
        "triton-splitkv",
        "xhal.platforms.cuda.providers:SplitKVFlashInferProvider",
        _req(FLASHINFER, TRITON, dtypes=_HALF),
        35,
        description=(
            "single-launch split-KV Triton decode for the decode buckets where it measured "
            "faster (splitkv_seqs), FlashInfer's decode for the others"
        ),
    ),
    # decode only, below triton-splitkv: it conforms but measured slower on an H100 (1B 23.0
    # against 18.6 us a layer, MoE 32.4 against 31.5; docs/h200-results.md, sixteenth session).
    # The suite runs it like every solution; XHAL_KERNEL_PAGED_DECODE_ATTENTION=native-block
    # picks it
    Solution(
        "paged_decode_attention",
        "native-block",
        "xhal.platforms.cuda.providers:SplitKVBlockProvider",
        Requirement(
            device_type="cuda",
            min_compute_capability=(9, 0),
            dtypes=_HALF,
            packages=(FLASHINFER, TRITON),
        ),
        34,
        description=(
            "triton-splitkv, and a one-sequence decode step's whole attention block (norm, qkv, "
            "q/k norm, rotary, KV write, split-KV attention, o) in one persistent launch "
            "(kernels/attn_block.cu, built by NVRTC)"
        ),
    ),
    # decode only: a prefill step on this backend runs its Triton fallback, so it is no
    # paged_prefill_attention solution
    Solution(
        "paged_decode_attention",
        "tilelang",
        "xhal.platforms.cuda.providers:TileLangAttentionProvider",
        Requirement(device_type="cuda", dtypes=_HALF, head_dims=(128,), packages=(TILELANG,)),
        25,
        description="TileLang split-KV decode (head dim 128, no window or soft cap); Triton beyond",
    ),
)
