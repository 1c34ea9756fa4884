"""Launch shapes of the one-row stream GEMVs (``fused_gemv.py``): the heuristic, and ``TUNED``,
the shapes measured best on the H200 for the projections of the decode steps we benchmark.

What sets a small GEMV's rate is the weight bytes in flight per SM. Triton pipelines no load
that feeds no ``tl.dot`` (the loop's loads are plain ``ld.global``: no async copies, whatever
``num_stages`` says), so each program has about one weight tile in flight, and a grid of a few
hundred 8 x 512 tiles (qkv or o of a 2048-wide model) leaves 16-24 KB per SM, too few to cover
the memory latency; splitting K to fill the chip adds a reduce launch. Wider K tiles on narrower
row blocks (4 x 1024: 8 KB a tile, 4 programs per SM or more) and no split fix both.

Tried on the H200 and not used (``benchmarks/bench_decode_gemv.py``, 2026-12-01, 20:18 and
20:24 UTC, sweeps of every batch-1 projection of the 1B, MoE and 8B shapes, kernel of commit
445524e): loading a program's whole weight slice before the PDL wait (at best a tie: 1B o 3.68
us against 3.67), each step's tile loaded one step ahead of its products (0.77-1.11x the same
tile without; never the fastest shape), and persistent grids of 2-4 waves walking several row
blocks in one flat loop (0.65-0.91x the previous shape): fewer programs hold fewer bytes in
flight.

Tried on the H200 on 2026-12-02 and not taken (bench_decode_gemv, each config checked against
float64 and timed against this table's shape in the same run): weight tiles asked of L2 ahead
of their loads (``prefetch.global.L2``, which holds no register; 00:02 UTC, read 4.24 TB/s): one
tile ahead 0.95-1.03x, two or more 0.61-0.87x on every projection, and the one row it won alone
(1B o, 3.70 against 3.83 us) made the 1B step slower (0.979 against 0.972 ms, one process), so
that code went again. Weight tiles through TMA descriptors (``GemvConfig.tma``: Triton's
pipeliner does keep those ``num_stages - 1`` deep in shared memory without a ``tl.dot``; 00:11
UTC, read 4.18 TB/s, the 1B projections): 0.77-1.02x, at best ties (o 3.86 against 3.94 us,
gate_up 21.7 against 21.8, down 11.6 against 11.5; norm + qkv 0.81-0.98x), so no row takes it.
"""

from __future__ import annotations

import triton

from xhal.platforms.cuda.kernels.gemv import _TILES, GemvConfig, gemv_split_k

_PLAIN, _NORM, _SILU = 0, 1, 2

# one-row launch shapes measured best on the H200, by (prologue, N, K) with prologue 0 plain,
# 1 add + RMSNorm, 2 SiLU gate; others take the heuristic. Times are per call in a CUDA graph of
# 20 PDL-chained calls over weights cycled past L2 (bench_decode_gemv, 2026-12-01 20:24 UTC, read
# ceiling 4.28 TB/s), against the previous shape (PREVIOUS or the heuristic) in the same run.
TUNED: dict[tuple[int, int, int], GemvConfig] = {
    # Qwen3-30B-A3B's o projection (2048 x 4096): the heuristic's 256 row blocks split K in two
    # and add a reduce launch; 4-row blocks give 512 programs and no split (bench_moe_ops,
    # 2026-12-01 14:40 UTC: 7.3 us against 9.1 us; 20:24 UTC: 6.29 us, still the best)
    (0, 2048, 4096): GemvConfig(4, 512, 1, 4, 4),
    # Llama-3.2-1B: add + RMSNorm + qkv 3072 x 2048, 5.26 us against 6.48 (8 x 512)
    (1, 3072, 2048): GemvConfig(4, 1024, 1, 4, 1),
    # o 2048 x 2048, 3.67 us against 5.39 (8 x 512 split in two + the reduce launch)
    (0, 2048, 2048): GemvConfig(4, 1024, 1, 4, 1),
    # SiLU + down 2048 x 8192, 11.7 us against 12.6 (8 x 512 split in two + the reduce launch)
    (2, 2048, 8192): GemvConfig(8, 2048, 1, 8, 1),
}
# Not taken: Qwen3-30B-A3B's add + RMSNorm + qkv (5120 x 2048) at 4 x 1024 streamed in 8.67 us
# against 9.78 alone but did not move that model's step (3.09 against 3.05 ms, 20:25 UTC); the
# 1B gate_up and every 8B projection stay on 8 x 512 (no shape was faster by more than 3%).

# the table before the shapes above, the benchmarks' peer (benchmarks/pdl_variants.py)
PREVIOUS: dict[tuple[int, int, int], GemvConfig] = {
    (0, 2048, 4096): GemvConfig(4, 512, 1, 4, 4),
}


def fused_gemv_config(
    M: int,
    N: int,
    K: int,
    num_sms: int = 132,
    prologue: int = _PLAIN,
    table: dict[tuple[int, int, int], GemvConfig] | None = None,
) -> GemvConfig:
    """``table`` (``TUNED`` by default) for one row where measured, else ``gemv_config``'s
    heuristic for the CUDA-core path (M <= 16)."""
    table = TUNED if table is None else table
    if M == 1 and (prologue, N, K) in table:
        return table[(prologue, N, K)]
    block_n, block_k = _TILES[triton.next_power_of_2(M)]
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    split_k = gemv_split_k(N, K, block_n, block_k, num_sms)
    steps = triton.cdiv(triton.cdiv(K, block_k), split_k)
    return GemvConfig(block_n, block_k, split_k, 4, min(steps, 3))
