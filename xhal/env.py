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
    projection, the SiLU gate into the down projection, rotary into the KV write); on by default,
    ``0`` runs the unfused sequence of the same ops (to measure one against the other)."""
    return _flag("XHAL_CUDA_FUSED", True)


def cuda_pdl() -> bool:
    """``XHAL_CUDA_PDL=1``: launch the CUDA platform's decode GEMVs with programmatic dependent
    launch (sm_90+), so each is scheduled while the kernel before it drains; off by default."""
    return _flag("XHAL_CUDA_PDL", False)
