"""Typed environment settings, all under the ``XHAL_`` prefix, read in this one module."""

from __future__ import annotations

import os


def plugins() -> list[str]:
    """``XHAL_PLUGINS``: comma-separated modules imported before platforms are looked up; each may
    call ``xhal.platforms.register``. Child processes inherit it, so a plugin registered this way
    is visible in spawned ranks too."""
    raw = os.environ.get("XHAL_PLUGINS", "")
    return [m.strip() for m in raw.split(",") if m.strip()]


def cache_dir() -> str:
    """``XHAL_CACHE_DIR``: where generated artefacts (the built-in default model) are kept."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "xhal")
    return os.environ.get("XHAL_CACHE_DIR", default)


def cpu_native() -> bool:
    """``XHAL_CPU_NATIVE=0``: cpu-fast runs without its C kernels (built with the machine's C
    compiler on first use, cached under ``XHAL_CACHE_DIR``), on its torch path; on by default."""
    return _flag("XHAL_CPU_NATIVE", True)


def npu_kv_layout() -> str:
    """``XHAL_NPU_KV_LAYOUT``: the NPU backend's paged KV cache layout, ``"NHD"`` (default: the
    executor's ``[num_blocks, block_size, num_kv_heads, head_dim]``, which FIA reads as
    ``(blocknum, blocksize, H)``) or ``"HND"`` (``[num_blocks, num_kv_heads, block_size,
    head_dim]``, FIA's ``(blocknum, KV_N, blocksize, D)``, the layout its documentation
    recommends for speed; the host must allocate caches by ``kv_cache_shape``)."""
    value = os.environ.get("XHAL_NPU_KV_LAYOUT", "NHD")
    if value not in ("NHD", "HND"):
        raise ValueError(f"XHAL_NPU_KV_LAYOUT={value!r}: use NHD (default) or HND")
    return value


def check_metadata() -> bool:
    """``XHAL_CHECK_METADATA=1``: the reference server checks every step's metadata values
    (``from_xllm(check=True)``, ``AttentionMetadata.validate``), a debug aid that costs host time
    per step; off by default, shapes and dtypes are checked either way."""
    return os.environ.get("XHAL_CHECK_METADATA", "0").strip().lower() in ("1", "true", "yes", "on")


def flashinfer_prefill() -> str:
    """``XHAL_FLASHINFER_PREFILL``: the FlashInfer backend of the CUDA platform's prefill wrapper,
    ``"fa2"`` (default: the same JIT module as the tensor-core decode wrapper), ``"fa3"`` or
    ``"auto"`` (FlashInfer's own choice)."""
    value = os.environ.get("XHAL_FLASHINFER_PREFILL", "fa2")
    if value not in ("fa2", "fa3", "auto"):
        raise ValueError(f"XHAL_FLASHINFER_PREFILL={value!r}: use fa2, fa3 or auto")
    return value


def cuda_gemv_max_rows(limit: int) -> int | None:
    """``XHAL_CUDA_GEMV_MAX_ROWS``: rows up to which the CUDA platform's linear runs our GEMV
    instead of cuBLAS (0: cuBLAS always; at most ``limit``, the kernel's own bound); ``None``
    when unset, leaving the platform's measured default."""
    value = os.environ.get("XHAL_CUDA_GEMV_MAX_ROWS")
    if value is None:
        return None
    if not value.isdigit() or not 0 <= int(value) <= limit:
        raise ValueError(f"XHAL_CUDA_GEMV_MAX_ROWS={value!r}: give 0..{limit} (0: cuBLAS always)")
    return int(value)


def kernel_overrides() -> dict[str, str]:
    """``XHAL_KERNEL_<OP>=<solution>``: force an op's solution, e.g. ``XHAL_KERNEL_RMS_NORM=torch``
    or ``XHAL_KERNEL_PAGED_DECODE_ATTENTION=triton`` (``xhal-serve --kernel OP=SOLUTION`` sets
    these). Returns setting name -> solution name for every non-empty one; which names are ops is
    the solutions' business (``xhal.solutions.kernels`` refuses an unknown one, listing the ops)."""
    return {
        key: value.strip()
        for key, value in os.environ.items()
        if key.startswith("XHAL_KERNEL_") and value.strip()
    }


def autotune() -> bool:
    """``XHAL_AUTOTUNE=0``: never time configs (a solution with a config space takes its cached
    winner, else its first config); on by default."""
    return os.environ.get("XHAL_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def serve_cpu_platform() -> str:
    """``XHAL_SERVE_CPU_PLATFORM``: the platform ``xhal-serve --device cpu`` runs on, ``cpu-fast``
    (default: the batched, eager CPU platform) or ``cpu`` (the reference, to rule out the fast
    attention when chasing a wrong output)."""
    value = os.environ.get("XHAL_SERVE_CPU_PLATFORM", "cpu-fast")
    if value not in ("cpu-fast", "cpu"):
        raise ValueError(f"XHAL_SERVE_CPU_PLATFORM={value!r}: use cpu-fast (default) or cpu")
    return value


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"{name}={raw!r}: use 1 or 0")
    return value in ("1", "true", "yes", "on")


def cuda_fused() -> bool:
    """``XHAL_CUDA_FUSED``: the CUDA platform's fused decode kernels (RMSNorm into the following
    projection, the SiLU gate into the down projection, rotary into the KV write, a mixture of
    experts' norm + router + top-k, Qwen3's q/k norms); on by default,
    ``0`` runs the unfused sequence of the same ops (to measure one against the other)."""
    return _flag("XHAL_CUDA_FUSED", True)


def cuda_fused_qk_norm() -> bool:
    """``XHAL_CUDA_FUSED_QK_NORM``: Qwen3's per-head q/k RMSNorm inside the split-KV decode
    launch for the decode steps that take it (``kernels/splitkv_decode.py``), instead of its own
    launch before; on by default (with ``XHAL_CUDA_FUSED``), ``0`` keeps the separate launch (the
    peer it is measured against)."""
    return _flag("XHAL_CUDA_FUSED_QK_NORM", True)


def cuda_mlp_block() -> bool:
    """``XHAL_CUDA_MLP_BLOCK``: a decode step's gated MLP block (residual add, norm, gate_up, SiLU
    gate, down) as one persistent launch on sm_90+ where it takes the shape
    (``kernels/mlp_block.cu``); on by default (with ``XHAL_CUDA_FUSED``), ``0`` runs the two fused
    GEMVs (the peer it is measured against). Read per call: a graph keeps what it was captured
    with."""
    return _flag("XHAL_CUDA_MLP_BLOCK", True)


def cuda_native_gemv() -> bool:
    """``XHAL_CUDA_NATIVE_GEMV``: a decode graph's one-row projections outside the MLP block
    (qkv with its norm, o, the LM head) on the native stream GEMV on sm_90+
    (``kernels/gemv_stream.cu``); on by default, ``0`` runs the Triton stream GEMVs (the peer it
    is measured against). Read per call: a graph keeps what it was captured with."""
    return _flag("XHAL_CUDA_NATIVE_GEMV", True)


def cuda_skinny_mma() -> str:
    """``XHAL_CUDA_SKINNY_MMA``: a decode graph's 2- to 64-row projections on the tensor-core
    skinny GEMM on sm_90+ (``kernels/skinny_mma.cu``: a cluster's K-split partials summed on
    chip) or on cuBLAS. ``auto`` (default): whichever a timing on this machine found faster,
    shape by shape (``platforms/cuda/skinny_choice.py``); ``1``: the skinny GEMM wherever it
    takes the shape (the benchmarks' peer ``auto-skinny-mma``); ``0``: cuBLAS (``auto-no-skinny``).
    Read per call: a graph keeps what it was captured with."""
    raw = os.environ.get("XHAL_CUDA_SKINNY_MMA", "auto")
    value = raw.strip().lower()
    if value == "auto":
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"XHAL_CUDA_SKINNY_MMA={raw!r}: use auto (default), 1 or 0")


OVERLAP_PARTS = ("mlp", "qkv", "o")


def cuda_overlap() -> frozenset[str]:
    """``XHAL_CUDA_OVERLAP``: which of a one-row decode graph's stream kernels run beside their
    neighbours, ``1`` (all, the default), ``0`` (none) or a comma list of ``mlp`` (the MLP block
    takes half an SM's shared memory, ``native.beside_share``, where that keeps its rings deep
    enough, ``mlp_block.BESIDE_DEPTH``, and lets the next kernel launch before its wait), ``qkv``
    (the norm + qkv stream GEMV takes half an SM) and ``o`` (the layer's plain projections run on
    the native stream GEMV in half an SM and let the next kernel launch before their wait; the
    one-sequence split-KV launch ahead of o then triggers right after its wait,
    ``splitkv_decode.TRIGGER_BESIDE``). The next kernel's CTAs then request their weights while
    the kernel ahead still streams or waits (``xhal/platforms/cuda/pdl.py``; what it measured:
    docs/h200-results.md, twenty-first session). Read per call: a graph keeps what it was
    captured with."""
    raw = os.environ.get("XHAL_CUDA_OVERLAP", "1").strip().lower()
    if raw in ("0", "", "off", "false", "no"):
        return frozenset()
    if raw in ("1", "on", "true", "yes"):
        return frozenset(OVERLAP_PARTS)
    parts = frozenset(p.strip() for p in raw.split(","))
    if not parts <= set(OVERLAP_PARTS):
        raise ValueError(
            f"XHAL_CUDA_OVERLAP={raw!r}: use 1, 0 or a comma list of {', '.join(OVERLAP_PARTS)}"
        )
    return parts


def cuda_one_shot_allreduce() -> bool:
    """``XHAL_CUDA_ONE_SHOT_ALLREDUCE``: the CUDA platform's all-reduces of up to 1 MiB on 2-8
    ranks as torch's symmetric-memory one-shot all-reduce (each rank reads every peer's buffer
    over NVLink; ``platforms/cuda/collective.py``) instead of NCCL's; off by default (not yet
    measured on two GPUs), ``1`` turns it on. Read when a collective is made."""
    return _flag("XHAL_CUDA_ONE_SHOT_ALLREDUCE", False)


def cuda_triton_activation() -> bool:
    """``XHAL_CUDA_TRITON_ACTIVATION``: the CUDA platform's gated activations (``silu_and_mul``,
    ``gelu_and_mul``, and the activation before the down projection at 2+ rows) as one Triton
    launch; on by default, ``0`` runs the float32 torch sequence (the peer it is measured
    against)."""
    return _flag("XHAL_CUDA_TRITON_ACTIVATION", True)


def cuda_pdl() -> bool:
    """``XHAL_CUDA_PDL``: launch the CUDA platform's decode kernels (GEMVs, fused GEMVs, rotary +
    KV write, norms, the MoE router) with programmatic dependent launch on sm_90+, so each is
    scheduled while the kernel before it drains (``xhal/platforms/cuda/pdl.py``: the rule each
    kernel follows, and what it measured); on by default, ``0`` turns it off."""
    return _flag("XHAL_CUDA_PDL", True)


def cuda_pdl_trigger() -> str:
    """``XHAL_CUDA_PDL_TRIGGER``: where a PDL GEMV lets the next kernel launch, ``auto`` (default:
    right after its wait below ``pdl.EARLY_BYTES`` of weight, after its weight stream above, and
    always after it for the add + RMSNorm GEMVs), ``by-size`` (the size rule alone), ``early``
    (always right after the wait) or ``late`` (always after the weight stream)."""
    value = os.environ.get("XHAL_CUDA_PDL_TRIGGER", "auto").strip().lower()
    if value not in ("auto", "by-size", "early", "late"):
        raise ValueError(
            f"XHAL_CUDA_PDL_TRIGGER={value!r}: use auto (default), by-size, early or late"
        )
    return value
