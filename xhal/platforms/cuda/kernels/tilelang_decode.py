"""TileLang paged decode attention (GQA, split-KV), JIT-compiled on the machine that runs it.

One CTA per (KV head, sequence, split) attends the query heads of its KV head (the GQA group,
padded to a 16- or 64-row tensor-core tile; padding rows repeat a real head and are never
stored) over
its split's share of the sequence's keys. Keys are gathered tile by tile through the block table,
so any page size works; keys past the sequence's length are zero-filled (never read from stale
pages) and masked. Each split writes its normalized partial output and log-sum-exp; a second
kernel of the same program merges the splits. Only the head dim, the page size and the dtype are
compile-time: batch, head counts, number of blocks, splits, strides and the scale are read from
the arguments at launch, so one compiled program serves every batch and every graph bucket.

Requirements: CUDA, compute capability 8.0+, fp16 / bf16, GQA group <= 64, last dimension of q
contiguous, no sliding window, no logits soft cap.
"""

# no ``from __future__ import annotations``: TileLang evaluates the kernel's parameter annotations
# (shapes over closure variables) when it builds the program
import functools

import torch

# query-head rows per CTA: the GQA group padded to a tensor-core tile of 16 or 64 rows
_BLOCK_HS = (16, 64)
_BLOCK_N = 64  # keys per tile
_THREADS = 128
_LOG2E = 1.4426950408889634
# TileLang's PassConfigKey values: the gathered tiles are not TMA boxes, and no producer warps
_PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
MAX_GROUP = _BLOCK_HS[-1]


def _program(head_dim: int, page_size: int, dtype: str, block_h: int = 64):
    import tilelang.language as T  # here, not at import: the module loads without TileLang

    batch, num_heads, num_kv_heads, num_blocks, max_pages, num_splits = T.dynamic(
        "batch, num_heads, num_kv_heads, num_blocks, max_pages, num_splits"
    )
    q_stride, table_stride = T.dynamic("q_stride, table_stride")
    acc_t = "float32"
    # a 64-row tile is one Hopper warpgroup MMA (warps split rows); a 16-row tile is one MMA row
    # block (warps split columns)
    policy = T.GemmWarpPolicy.FullRow if block_h >= 64 else T.GemmWarpPolicy.FullCol
    neg_inf = -T.infinity(acc_t)

    @T.prim_func
    def decode(
        Q: T.StridedTensor((batch, num_heads, head_dim), (q_stride, head_dim, 1), dtype),
        K: T.Tensor((num_blocks, page_size, num_kv_heads, head_dim), dtype),
        V: T.Tensor((num_blocks, page_size, num_kv_heads, head_dim), dtype),
        block_table: T.StridedTensor((batch, max_pages), (table_stride, 1), "int32"),
        kv_lens: T.Tensor((batch,), "int32"),
        scale_log2: T.float32,
        part_out: T.Tensor((batch, num_heads, num_splits, head_dim), acc_t),
        part_lse: T.Tensor((batch, num_heads, num_splits), acc_t),
        Out: T.Tensor((batch, num_heads, head_dim), dtype),
    ):
        with T.Kernel(num_kv_heads, batch, num_splits, threads=_THREADS) as (kvh, b, split):
            q_s = T.alloc_shared((block_h, head_dim), dtype)
            k_s = T.alloc_shared((_BLOCK_N, head_dim), dtype)
            v_s = T.alloc_shared((_BLOCK_N, head_dim), dtype)
            scores = T.alloc_fragment((block_h, _BLOCK_N), acc_t)
            # 16-row tiles split columns across warps, which the PV product cannot read from
            # registers: the probabilities go through shared memory there
            if block_h >= 64:
                probs = T.alloc_fragment((block_h, _BLOCK_N), dtype)
            else:
                probs = T.alloc_shared((block_h, _BLOCK_N), dtype)
            acc = T.alloc_fragment((block_h, head_dim), acc_t)
            row_max = T.alloc_fragment((block_h,), acc_t)
            prev_max = T.alloc_fragment((block_h,), acc_t)
            rescale = T.alloc_fragment((block_h,), acc_t)
            tile_sum = T.alloc_fragment((block_h,), acc_t)
            row_sum = T.alloc_fragment((block_h,), acc_t)

            # scalars held in registers: as plain expressions TVM would inline the divisions by
            # the runtime split count into every index of the tile loops
            group = T.alloc_var("int32", init=num_heads // num_kv_heads)
            kv_len = T.alloc_var("int32", init=kv_lens[b])
            num_tiles = T.alloc_var("int32", init=T.ceildiv(kv_len, _BLOCK_N))
            per_split = T.alloc_var("int32", init=T.ceildiv(num_tiles, num_splits))
            first = T.alloc_var("int32", init=split * per_split)
            count = T.alloc_var("int32", init=T.max(T.min(first + per_split, num_tiles) - first, 0))

            # rows past the group repeat its last head: finite, computed, never stored
            for i, d in T.Parallel(block_h, head_dim):
                q_s[i, d] = Q[b, kvh * group + T.min(i, group - 1), d]
            T.fill(acc, 0)
            T.fill(row_sum, 0)
            T.fill(row_max, neg_inf)

            for t in T.Pipelined(count, num_stages=2):
                base = (first + t) * _BLOCK_N
                # K and V of the tile in one gather: twice the bytes in flight per CTA
                for j, d in T.Parallel(_BLOCK_N, head_dim):
                    page = block_table[b, T.min((base + j) // page_size, max_pages - 1)]
                    k_s[j, d] = T.if_then_else(
                        base + j < kv_len, K[page, (base + j) % page_size, kvh, d], T.cast(0, dtype)
                    )
                    v_s[j, d] = T.if_then_else(
                        base + j < kv_len, V[page, (base + j) % page_size, kvh, d], T.cast(0, dtype)
                    )
                T.clear(scores)
                T.gemm(q_s, k_s, scores, transpose_B=True, policy=policy)
                for i, j in T.Parallel(block_h, _BLOCK_N):
                    scores[i, j] = T.if_then_else(
                        base + j < kv_len, scores[i, j] * scale_log2, neg_inf
                    )
                T.copy(row_max, prev_max)
                T.reduce_max(scores, row_max, dim=1, clear=False)
                for i in T.Parallel(block_h):
                    rescale[i] = T.exp2(prev_max[i] - row_max[i])
                for i, j in T.Parallel(block_h, _BLOCK_N):
                    scores[i, j] = T.exp2(scores[i, j] - row_max[i])
                T.reduce_sum(scores, tile_sum, dim=1)
                for i in T.Parallel(block_h):
                    row_sum[i] = row_sum[i] * rescale[i] + tile_sum[i]
                for i, d in T.Parallel(block_h, head_dim):
                    acc[i, d] *= rescale[i]
                T.copy(scores, probs)
                T.gemm(probs, v_s, acc, policy=policy)

            # an empty split (short sequence, padding row) reports lse -inf and weighs nothing
            for i, d in T.Parallel(block_h, head_dim):
                if i < group:
                    part_out[b, kvh * group + i, split, d] = T.if_then_else(
                        row_sum[i] > 0, acc[i, d] / row_sum[i], T.cast(0, acc_t)
                    )
            for i in T.Parallel(block_h):
                if i < group:
                    part_lse[b, kvh * group + i, split] = T.if_then_else(
                        row_sum[i] > 0, T.log2(row_sum[i]) + row_max[i], neg_inf
                    )

        with T.Kernel(num_heads, batch, threads=_THREADS) as (h, b):
            merged = T.alloc_fragment((head_dim,), acc_t)
            lse_max = T.alloc_var(acc_t, init=neg_inf)
            total = T.alloc_var(acc_t, init=0)
            weight = T.alloc_var(acc_t, init=0)
            T.clear(merged)
            for s in T.serial(num_splits):
                lse_max = T.max(lse_max, part_lse[b, h, s])
            for s in T.serial(num_splits):
                weight = T.if_then_else(
                    part_lse[b, h, s] == neg_inf,
                    T.cast(0, acc_t),
                    T.exp2(part_lse[b, h, s] - lse_max),
                )
                total += weight
                for d in T.Parallel(head_dim):
                    merged[d] += weight * part_out[b, h, s, d]
            for d in T.Parallel(head_dim):
                Out[b, h, d] = T.cast(
                    T.if_then_else(total > 0, merged[d] / total, T.cast(0, acc_t)), dtype
                )

    return decode


def block_rows(group: int) -> int:
    """The smallest tile of query-head rows that holds a GQA group."""
    for rows in _BLOCK_HS:
        if group <= rows:
            return rows
    raise ValueError(f"TileLang decode attention takes GQA groups up to {MAX_GROUP}, not {group}")


@functools.cache
def compiled(head_dim: int, page_size: int, dtype: torch.dtype, block_h: int):
    """The compiled program for one (head dim, page size, dtype, row tile): seconds of nvcc at
    most once per process (and TileLang's disk cache after that), so backends call this when they
    are created, never inside a graph capture."""
    import tilelang

    if dtype not in _DTYPES:
        raise ValueError(f"TileLang decode attention takes fp16 or bf16, not {dtype}")
    program = _program(head_dim, page_size, _DTYPES[dtype], block_h)
    return tilelang.compile(program, out_idx=None, target="cuda", pass_configs=_PASS_CONFIGS)


def num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits of each sequence's keys so that about two waves of CTAs fill the SMs; host
    values only (shapes), never the lengths, so a graph bucket keeps one split count."""
    ctas = max(batch * num_kv_heads, 1)
    return max(1, min(16, -(-2 * num_sms // ctas)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    splits: int,
    block_h: int | None = None,
) -> torch.Tensor:
    """One query row per sequence: q ``[B, H, D]`` (row stride free), caches
    ``[num_blocks, block_size, Hkv, D]``, block_table int32 ``[B, max_pages]`` (row stride free),
    kv_lens int32 ``[B]`` including this step's key; writes out ``[B, H, D]`` (contiguous). Graph
    safe: no host sync, allocations sized by shapes only."""
    batch, num_heads, head_dim = q.shape
    if block_h is None:
        block_h = block_rows(num_heads // k_cache.shape[2])
    kernel = compiled(head_dim, k_cache.shape[1], q.dtype, block_h)
    part_out = torch.empty(
        (batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    kernel(q, k_cache, v_cache, block_table, kv_lens, scale * _LOG2E, part_out, part_lse, out)
    return out
