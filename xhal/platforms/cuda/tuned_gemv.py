"""The "triton-tuned" linear solution: our GEMV with its launch shape picked by timing on the
machine (the heuristic's shape first, then wider row blocks and other K splits), cuBLAS where the
GEMV does not apply. Not chosen by default (the plain "triton" solution ranks higher); force it
with ``XHAL_KERNEL_LINEAR=triton-tuned`` and warm it with ``xhal-tune``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def bucket(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str:
    """Rows rounded up to a power of two (the decode graph buckets), the weight's shape, dtype."""
    rows = x.numel() // x.shape[-1] if x.dim() > 1 else 1
    m = 1 << max(0, (rows - 1).bit_length())
    return f"m{m}-n{weight.shape[0]}-k{weight.shape[-1]}-{str(x.dtype).removeprefix('torch.')}"


class TunedGemv:
    """A provider (see ``xhal.solutions.Solution``)."""

    def __init__(self, platform: object) -> None:
        from xhal.platforms.cuda.kernels import gemv

        self._gemv = gemv
        # kernels compiled (launched once eagerly) per shape and config: compiling cannot happen
        # under graph capture, so a capture of an unseen one takes cuBLAS (as CudaOps.linear does)
        self._loaded: set[tuple] = set()

    def _config(
        self, x: torch.Tensor, weight: torch.Tensor, block_n_scale: int, split_scale: float
    ):
        g = self._gemv
        (m, k), n = x.shape, weight.shape[0]
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        base = g.gemv_config(m, n, k, sms)
        block_n = base.block_n * block_n_scale
        split_k = max(1, int(base.split_k * split_scale))
        k_steps = math.ceil(k / base.block_k)
        steps = math.ceil(k_steps / split_k)  # per split: pipelining deeper than that is moot
        return g.GemvConfig(
            block_n, base.block_k, split_k, base.num_warps, max(1, min(base.num_stages, steps))
        )

    def linear(self, x, weight, bias=None, *, block_n_scale: int = 1, split_scale: float = 1.0):
        if x.dim() != 2 or not self._gemv.supports_gemv(x, weight):
            return F.linear(x, weight, bias)
        config = self._config(x, weight, block_n_scale, split_scale)
        key = (x.shape, weight.shape, x.stride(), x.dtype, x.device, bias is not None, config)
        if x.is_cuda and torch.cuda.is_current_stream_capturing() and key not in self._loaded:
            return F.linear(x, weight, bias)
        out = self._gemv.gemv(x, weight, bias, config)
        self._loaded.add(key)
        return out
