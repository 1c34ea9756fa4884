// The steps of attn_block.cu that are not its phases' skeleton: cached and asynchronous loads,
// the one-way grid barrier, the K / V tile loads of phase 2 and the merge of a
// KV head's splits. Included by attn_block.cu after its shape macros (GROUP, HEAD_DIM, SPLITS,
// PAGE, KV_TILE, ...), which these steps read.

#pragma once

__device__ __forceinline__ float ldcg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int ldcg_i32(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// A barrier of the CTAs that add to a 64-bit arrival count that only grows (the whole grid, 2 *
// gridDim.x a launch; or one KV head's splits, SPLITS a launch): each CTA adds its arrival with a
// release reduction (no round trip) and waits until the count reaches `target`. The release / acquire pair at gpu scope, with the CTA barriers around it,
// carries every thread's stores before the barrier to every thread after it.
__device__ __forceinline__ void grid_sync(u64* count, u64 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(count) : "memory");
        u64 v;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(count) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

__device__ __forceinline__ float lds_f16(u32 addr) {  // one dtype value from shared memory
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
    return lo_f32((u32)v);
}

// keys [first, first + KV_TILE) of KV head g, clipped to `end`, into the K and V tiles at
// k_dst / v_dst: one 16-byte chunk per cp.async, a key's head at its page's row
__device__ __forceinline__ void load_tile(u32 k_dst, u32 v_dst, const u16* k_cache,
                                          const u16* v_cache, const int* table, int first,
                                          int end, int g) {
    for (int c = threadIdx.x; c < KV_TILE * CHUNKS_ROW; c += THREADS) {
        const int j = c / CHUNKS_ROW, part = c % CHUNKS_ROW, pos = first + j;
        if (pos >= end) {  // zeros: the values loop reads every row of a tile (p = 0 there)
            const chunk16 zero = {0u, 0u, 0u, 0u};
            sts128(k_dst + c * 16, zero);
            sts128(v_dst + c * 16, zero);
            continue;
        }
        const int page = ldcg_i32(table + pos / PAGE);
        const u64 row = ((u64)page * PAGE + pos % PAGE) * NUM_KV + g;
        cp_async16(k_dst + c * 16, k_cache + row * HEAD_DIM + part * 8);
        cp_async16(v_dst + c * 16, v_cache + row * HEAD_DIM + part * 8);
    }
}

// Every split of KV head g adds its arrival to `count` and waits for the group's `target`, then
// merges its slice of the group's GROUP * HEAD_DIM outputs from the splits' partials (max and
// sum per head in partial_ml, unnormalized outputs in partial_acc) into attn, rounded to the
// dtype. `scratch`: shared memory for 3 * SPLITS * GROUP + SLICE * SPLITS floats.
__device__ __forceinline__ void merge_group_slice(
    float* scratch, const float* partial_ml, const float* partial_acc, u64* count, u64 target,
    u16* attn, int g, int split)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    grid_sync(count, target);  // a barrier of the group's splits alone
    // the group's (max, sum) per split and head, one weight per split and head, the slice's
    // products per split: the loads of a slice are all in flight at once
    float* ml = scratch;                   // [SPLITS][GROUP][2]
    float* wts = ml + 2 * SPLITS * GROUP;  // [SPLITS][GROUP]
    float* prod = wts + SPLITS * GROUP;    // [SLICE][SPLITS]
    constexpr int SLICE = (GROUP * HEAD_DIM + SPLITS - 1) / SPLITS;
    const float* src = partial_ml + (u64)g * SPLITS * GROUP * 2;
    for (int i = tid; i < 2 * SPLITS * GROUP; i += THREADS) ml[i] = ldcg_f32(src + i);
    __syncthreads();
    for (int r = warp; r < GROUP; r += WARPS) {
        float m = NEG_INF;
        for (int s = lane; s < SPLITS; s += 32) m = fmaxf(m, ml[(s * GROUP + r) * 2]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.f;
        for (int s = lane; s < SPLITS; s += 32)
            l = fmaf(ml[(s * GROUP + r) * 2 + 1], __expf(ml[(s * GROUP + r) * 2] - m), l);
        l = warp_sum(l);
        for (int s = lane; s < SPLITS; s += 32)
            wts[s * GROUP + r] = __expf(ml[(s * GROUP + r) * 2] - m) / l;
    }
    __syncthreads();
    const float* accs = partial_acc + (u64)g * SPLITS * GROUP * HEAD_DIM;
    const int first_e = split * SLICE;
    for (int i = tid; i < SLICE * SPLITS; i += THREADS) {
        const int e = first_e + i / SPLITS, s = i % SPLITS;
        if (e < GROUP * HEAD_DIM)
            prod[i] = wts[s * GROUP + e / HEAD_DIM]
                      * ldcg_f32(accs + (u64)s * GROUP * HEAD_DIM + e);
    }
    __syncthreads();
    for (int i = tid; i < SLICE; i += THREADS) {
        const int e = first_e + i;
        if (e >= GROUP * HEAD_DIM) break;
        float o = 0.f;
        for (int s = 0; s < SPLITS; ++s) o += prod[i * SPLITS + s];
        attn[(g * GROUP) * HEAD_DIM + e] = to_dtype(o);
    }
}
