// A decode GEMV streaming its weights through TMA bulk copies (sm_90+), optionally with the
// residual add and RMSNorm ahead of it:
//
//   NORM=0:  out = x @ w^T
//   NORM=1:  residual_out = x + residual (rounded to the dtype);
//            out = (residual_out * norm_w / rms(residual_out)) @ w^T   (the normed rows not rounded)
//
// for M rows. One CTA per SM walks a contiguous share of the weight in units of R rows, through a
// ring of STAGES shared-memory stages; the first stages are requested before the
// programmatic-dependent-launch wait, so a slice that fits the ring (a 2048-wide qkv or o
// projection: under 100 KB per SM) is on chip by the time the kernel ahead has finished. The input
// rows live in registers (stream_common.cuh's load_input); each stage's rows are reduced over
// the CTA and stored.
//
// Compile-time: DTYPE_BF16, M_ROWS, K, R, STAGES, NORM, USE_PDL, EARLY. Runtime: pointers, N (rows
// of w), the row strides of x and residual (elements), eps.
//
// EARLY=1 lets the next kernel launch as soon as every CTA has requested its first stages, before
// the wait (the overlap of env.cuda_overlap: the ring then takes at most half an SM's shared
// memory, so the next kernel's CTA fits beside it and requests its own weights while this one
// runs). Else the next kernel launches after the last stage. pdl.py has why either is safe.

#define THREADS 256
#define WARPS (THREADS / 32)

#include "stream_common.cuh"

#ifndef EARLY
#define EARLY 0
#endif

#define CPT ((K / 8 + THREADS - 1) / THREADS)
#define STAGE_BYTES (R * K * 2)
#define PARTS_FLOATS (2 * WARPS * R * M_ROWS)

static_assert(K % 8 == 0, "rows are read in 16-byte chunks");

__device__ __forceinline__ void issue(u32 ring, u32 bar, const u16* w, u32 n, u32 unit, u32 slot) {
    const u32 first = unit * R, rows = (first + R <= n) ? R : n - first;  // the last unit may be short
    mbar_expect(bar, rows * K * 2);
    bulk_copy(ring + slot * STAGE_BYTES, w + (u64)first * K, rows * K * 2, bar);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) gemv_stream(
    const u16* __restrict__ x, const u16* __restrict__ residual, const u16* __restrict__ norm_w,
    const u16* __restrict__ w, u16* __restrict__ out, u16* __restrict__ residual_out, u32 n,
    long long x_stride, long long res_stride, float eps)
{
    extern __shared__ unsigned char smem[];  // the dynamic base: 16-byte aligned at least
    float* parts = (float*)(smem + STAGES * STAGE_BYTES);
    float* red = parts + PARTS_FLOATS;         // [WARPS][M_ROWS]
    u64* bars = (u64*)(red + WARPS * M_ROWS);  // STAGES mbarriers
    const u32 ring = smem_u32(smem);
    const int tid = threadIdx.x;

    u32 begin, end;
    share((n + R - 1) / R, &begin, &end);
    const u32 units = end - begin;

    if (tid == 0) {  // weights first: nothing here depends on the kernel ahead
        for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(bars + s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 k = 0; k < units && k < STAGES; ++k) issue(ring, smem_u32(bars + k), w, n, begin + k, k);
    }
#if EARLY
    pdl_launch_dependents();  // the next kernel may launch beside this one
#endif
    pdl_wait();  // x and residual are the kernel ahead's
    __syncthreads();  // the mbarriers are initialised

    float in[CPT][M_ROWS][8];
    load_input<K, M_ROWS, CPT, NORM != 0>(
        in, x, residual, norm_w, residual_out, x_stride, res_stride, eps, blockIdx.x == 0, red);

    for (u32 k = 0; k < units; ++k) {
        const u32 slot = k % STAGES;
        mbar_wait(smem_u32(bars + slot), (k / STAGES) & 1);
        float* p = parts + (k & 1) * (WARPS * R * M_ROWS);
        // rows past n in a short last unit read stale stage bytes; their sums are never stored
        stage_dots<K, M_ROWS, CPT, R>(ring + slot * STAGE_BYTES, in, p);
        __syncthreads();  // the stage is read and its parts written
        if (tid == 0 && k + STAGES < units) {
            fence_async_shared();
            issue(ring, smem_u32(bars + slot), w, n, begin + k + STAGES, slot);
        }
        if (tid < R * M_ROWS) {
            const int r = tid % R, m = tid / R;
            const u32 row = (begin + k) * R + r;
            if (row < n) out[(u64)m * n + row] = to_dtype(stage_sum<M_ROWS, R>(p, r, m));
        }
    }
#if !EARLY
    pdl_launch_dependents();  // the weights are streamed: the next kernel may take the SMs
#endif
}
