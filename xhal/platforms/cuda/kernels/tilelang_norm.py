"""TileLang fused residual add + RMSNorm, out of place, one CTA per row.

``summed = x + residual`` rounded to the input dtype (the residual stream keeps it), then
``normed = summed * rsqrt(mean(summed^2) + eps) * weight`` in float32, rounded once: the same
numerics as the Triton kernel in ``norm.py``. The hidden size and dtype are compile-time, the row
count and eps are read at launch.

Requirements: CUDA, fp16 / bf16 / fp32, weight in the input's dtype, hidden size a multiple of
256 up to 16384 (others: the Triton kernel).
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's parameter annotations
# (shapes over closure variables) when it builds the program
import functools

import torch

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_THREADS = 256
MAX_HIDDEN = 16384


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n = x.shape[-1]
    return (
        x.dtype in _DTYPES and weight.dtype == x.dtype and n % _THREADS == 0 and 0 < n <= MAX_HIDDEN
    )


def _program(hidden: int, dtype: str):
    import tilelang.language as T  # here, not at import: the module loads without TileLang

    rows = T.dynamic("rows")
    acc_t = "float32"

    @T.prim_func
    def add_rms_norm(
        X: T.Tensor((rows, hidden), dtype),
        R: T.Tensor((rows, hidden), dtype),
        W: T.Tensor((hidden,), dtype),
        eps: T.float32,
        Normed: T.Tensor((rows, hidden), dtype),
        Summed: T.Tensor((rows, hidden), dtype),
    ):
        with T.Kernel(rows, threads=_THREADS) as row:
            s = T.alloc_fragment((1, hidden), acc_t)
            sq = T.alloc_fragment((1, hidden), acc_t)
            total = T.alloc_fragment((1,), acc_t)
            for i, j in T.Parallel(1, hidden):
                s[i, j] = T.cast(
                    T.cast(T.cast(X[row, j], acc_t) + T.cast(R[row, j], acc_t), dtype), acc_t
                )
            for i, j in T.Parallel(1, hidden):
                Summed[row, j] = T.cast(s[i, j], dtype)
                sq[i, j] = s[i, j] * s[i, j]
            T.reduce_sum(sq, total, dim=1)
            for i in T.Parallel(1):
                total[i] = T.rsqrt(total[i] / hidden + eps)
            for i, j in T.Parallel(1, hidden):
                Normed[row, j] = T.cast(s[i, j] * total[i] * T.cast(W[j], acc_t), dtype)

    return add_rms_norm


@functools.cache
def compiled(hidden: int, dtype: torch.dtype):
    """Seconds of nvcc once per (hidden size, dtype) and process: the first eager call of a shape
    (the graph runner's warm-up) pays it, never a capture."""
    import tilelang

    return tilelang.compile(_program(hidden, _DTYPES[dtype]), out_idx=None, target="cuda")


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed), new contiguous tensors; inputs untouched. Call only where ``supports``."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    normed, summed = x.new_empty(x.shape), x.new_empty(x.shape)
    if x2.shape[0]:
        compiled(n, x.dtype)(x2, r2, weight, eps, normed.view(-1, n), summed.view(-1, n))
    return normed, summed
