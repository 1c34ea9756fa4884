"""Launch shapes of the one-row stream GEMVs (``fused_gemv.py``): the heuristic, and ``TUNED``,
the shapes measured best on the H200 for the projections of the decode steps we benchmark.

A decode GEMV inside a graph pays a fixed cost besides its weight stream: the ramp (its first
loads issued only once its programs start and, under PDL, once the kernel ahead has finished)
and the tail (a partial last wave, a reduce launch when K is split). Three fields of
``StreamConfig`` beyond ``gemv.GemvConfig``'s address that:

- ``prefetch``: how many K steps of its first row block a program loads before it waits for the
  kernel ahead (one in the plain layout), so that under PDL whole weight slices are in flight
  during that kernel's tail;
- ``ahead``: each step's weight tile is loaded one step before its products (Triton pipelines
  only loads that feed ``tl.dot``, so otherwise a program has one tile in flight at a time and a
  stream depends on enough programs per SM to cover the memory latency);
- ``blocks``: row blocks per program (a persistent grid of about the SM count when > 1, each
  program streaming a contiguous range of rows in one flat, pipelined loop), so that no partial
  wave is left at the end and no program starts late.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from xhal.platforms.cuda.kernels.gemv import _TILES, gemv_split_k

_PLAIN, _NORM, _SILU = 0, 1, 2


class StreamConfig(NamedTuple):
    """Launch shape of the stream GEMVs; a 5-tuple (``GemvConfig``'s fields) takes the defaults
    of the last two."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    blocks: int = 1  # row blocks per program
    prefetch: int = 1  # K steps of the first row block loaded before the PDL wait
    ahead: int = 0  # 1: each step's weight tile loaded one step ahead of its products


# one-row launch shapes measured best on the H200, by (prologue, N, K) with prologue 0 plain,
# 1 add + RMSNorm, 2 SiLU gate; others take the heuristic. Each row names the run that chose it.
TUNED: dict[tuple[int, int, int], StreamConfig] = {
    # Qwen3-30B-A3B's o projection (2048 x 4096): the heuristic's 256 row blocks split K in two
    # and add a reduce launch; 4-row blocks give 512 programs and no split (bench_moe_ops,
    # 2026-12-01 14:40 UTC: 7.3 us against 9.1 us, per call over 8 distinct weights)
    (0, 2048, 4096): StreamConfig(4, 512, 1, 4, 4),
}

# the table of the tree before the prefetch / persistent layouts, kept as the benchmarks' peer
PREVIOUS: dict[tuple[int, int, int], StreamConfig] = {
    (0, 2048, 4096): StreamConfig(4, 512, 1, 4, 4),
}


def fused_gemv_config(
    M: int,
    N: int,
    K: int,
    num_sms: int = 132,
    prologue: int = _PLAIN,
    table: dict[tuple[int, int, int], StreamConfig] | None = None,
) -> StreamConfig:
    """``table`` (``TUNED`` by default) for one row where measured, else ``gemv_config``'s
    heuristic for the CUDA-core path (M <= 16)."""
    table = TUNED if table is None else table
    if M == 1 and (prologue, N, K) in table:
        return table[(prologue, N, K)]
    block_n, block_k = _TILES[triton.next_power_of_2(M)]
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    split_k = gemv_split_k(N, K, block_n, block_k, num_sms)
    steps = triton.cdiv(triton.cdiv(K, block_k), split_k)
    return StreamConfig(block_n, block_k, split_k, 4, min(steps, 3))
