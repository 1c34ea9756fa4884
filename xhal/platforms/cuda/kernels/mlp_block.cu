// The gated MLP block of a decode step in one persistent launch (sm_90+):
//
//   residual_out = x + residual                               (rounded to the dtype)
//   h            = residual_out * norm_weight / rms(residual_out)   (fp32, not rounded)
//   gate, up     = h @ w_gate_up^T                            (each rounded to the dtype)
//   act          = silu(gate) * up                            (rounded to the dtype)
//   out          = act @ w_down^T
//
// for M rows (1-4 tokens; the platform sends it one, mlp_block.py ROUTED_ROWS). One CTA per SM,
// every CTA resident at once (the grid is the SM count and one CTA fills an SM's shared memory;
// with EARLY it takes half, so an SM may hold a CTA of a kernel ahead or behind, or two of these:
// no kernel ahead waits for this one and none behind launches before every CTA here runs, so
// every CTA finds room).
// Phase 1 streams w_gate_up, phase 2 streams w_down; between them one grid-wide barrier (the down
// projection needs every act value). Weights never depend on the kernels ahead, so each CTA keeps
// its next weight rows in flight across every wait: the first phase-1 stages are requested before
// the programmatic-dependent-launch wait (the o projection ahead may still be running), the first
// phase-2 stages before the grid barrier. Weights move by TMA bulk copies (cp.async.bulk) into a
// ring of shared-memory stages, completed on mbarriers; the threads only read shared memory.
//
// The helpers are stream_common.cuh's. Compile-time shape (NVRTC -D options, see mlp_block.py):
// DTYPE_BF16 (else fp16), M_ROWS, HIDDEN, INTER (the per-rank intermediate size), PAIRS (gate/up
// row pairs per phase-1 stage), DOWN_ROWS (w_down rows per phase-2 stage), STAGES1, STAGES2,
// USE_PDL, EARLY (1: the next kernel may launch once every CTA has requested its first stages,
// before the wait, as in gemv_stream.cu; else after the last stage).
// Runtime: the pointers, the row strides of x and residual (elements) and eps.
//
// Sync words (sync[0] arrivals, sync[1] generation) are zero before the first launch and are
// left ready for the next one; launches sharing them must not overlap (one stream).

#define THREADS 256
#define WARPS (THREADS / 32)

#include "stream_common.cuh"

#ifndef EARLY
#define EARLY 0
#endif

#define CHUNKS2 (INTER / 8)    // 16-byte chunks of an intermediate-sized row
#define CPT1 ((HIDDEN / 8 + THREADS - 1) / THREADS)
#define CPT2 ((CHUNKS2 + THREADS - 1) / THREADS)
#define ROWS1 (2 * PAIRS)      // rows of a phase-1 stage: PAIRS gate rows, then PAIRS up rows
#define STAGE1_BYTES (ROWS1 * HIDDEN * 2)
#define STAGE2_BYTES (DOWN_ROWS * INTER * 2)
#define RING1 (STAGES1 * STAGE1_BYTES)
#define RING2 (STAGES2 * STAGE2_BYTES)
#define RING_BYTES (RING1 > RING2 ? RING1 : RING2)  // the phases take turns in one ring
#define ACT_BYTES (M_ROWS * INTER * 2)
#define PARTS_FLOATS (2 * WARPS * ROWS1 * M_ROWS)

static_assert(DOWN_ROWS <= ROWS1, "a phase-2 stage's parts fit in a phase-1 stage's");
static_assert(HIDDEN % 8 == 0 && INTER % 8 == 0, "rows are read in 16-byte chunks");
static_assert(INTER % PAIRS == 0 && HIDDEN % DOWN_ROWS == 0, "whole stages");

__device__ __forceinline__ void issue_stage1(u32 ring, u32 bar, const u16* w_gu, u32 unit, u32 slot) {
    const u32 half = PAIRS * HIDDEN * 2;  // bytes of PAIRS consecutive rows
    u32 dst = ring + slot * STAGE1_BYTES;
    const u16* gate = w_gu + (u64)unit * PAIRS * HIDDEN;
    const u16* up = w_gu + ((u64)INTER + (u64)unit * PAIRS) * HIDDEN;
    mbar_expect(bar, 2 * half);
    bulk_copy(dst, gate, half, bar);
    bulk_copy(dst + half, up, half, bar);
}

__device__ __forceinline__ void issue_stage2(u32 ring, u32 bar, const u16* w_down, u32 unit, u32 slot) {
    u32 dst = ring + slot * STAGE2_BYTES;
    mbar_expect(bar, STAGE2_BYTES);
    bulk_copy(dst, w_down + (u64)unit * DOWN_ROWS * INTER, STAGE2_BYTES, bar);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mlp_block(
    const u16* __restrict__ x, const u16* __restrict__ residual, const u16* __restrict__ norm_w,
    const u16* __restrict__ w_gu, const u16* __restrict__ w_down,
    u16* __restrict__ out, u16* __restrict__ residual_out, u16* __restrict__ act, u32* sync,
    long long x_stride, long long res_stride, float eps)
{
    extern __shared__ unsigned char smem[];  // the dynamic base: 16-byte aligned at least
    unsigned char* ring_p = smem;
    unsigned char* act_p = smem + RING_BYTES;
    float* parts = (float*)(act_p + ACT_BYTES);
    float* red = parts + PARTS_FLOATS;             // [WARPS][M_ROWS]
    u64* bars = (u64*)(red + WARPS * M_ROWS);  // STAGES1 then STAGES2 mbarriers
    const u32 ring = smem_u32(ring_p);
    const u32 act_s = smem_u32(act_p);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    u32 b1, e1, b2, e2;
    share(INTER / PAIRS, &b1, &e1);
    share(HIDDEN / DOWN_ROWS, &b2, &e2);
    const u32 n1 = e1 - b1, n2 = e2 - b2;

    // weights first: nothing here depends on the kernel ahead
    if (tid == 0) {
        for (int s = 0; s < STAGES1 + STAGES2; ++s) mbar_init(smem_u32(bars + s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 k = 0; k < n1 && k < STAGES1; ++k) issue_stage1(ring, smem_u32(bars + k), w_gu, b1 + k, k);
    }
#if EARLY
    pdl_launch_dependents();  // the next kernel may launch beside this one
#endif
    pdl_wait();  // x and residual are the kernel ahead's
    __syncthreads();  // the mbarriers are initialised

    u32 next_gen = 0;
    if (tid == 0) {
        asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(next_gen) : "l"(sync + 1) : "memory");
        next_gen += 1;
    }

    // ---- the residual add and RMSNorm: every CTA computes all of h, kept in registers ----
    float h[CPT1][M_ROWS][8];
    load_input<HIDDEN, M_ROWS, CPT1, true>(
        h, x, residual, norm_w, residual_out, x_stride, res_stride, eps, blockIdx.x == 0, red);

    // ---- phase 1: gate/up rows, SiLU gate, act to global ----
    for (u32 k = 0; k < n1; ++k) {
        const u32 slot = k % STAGES1;
        mbar_wait(smem_u32(bars + slot), (k / STAGES1) & 1);
        float* p = parts + (k & 1) * (WARPS * ROWS1 * M_ROWS);
        stage_dots<HIDDEN, M_ROWS, CPT1, ROWS1>(ring + slot * STAGE1_BYTES, h, p);
        __syncthreads();  // the stage is read and its parts written
        if (tid == 0 && k + STAGES1 < n1) {
            fence_async_shared();
            issue_stage1(ring, smem_u32(bars + slot), w_gu, b1 + k + STAGES1, slot);
        }
        if (tid < PAIRS * M_ROWS) {
            const int pair = tid % PAIRS, m = tid / PAIRS;
            // gate_up as the unfused projection stores it
            const float gate = round_dtype(stage_sum<M_ROWS, ROWS1>(p, pair, m));
            const float up = round_dtype(stage_sum<M_ROWS, ROWS1>(p, PAIRS + pair, m));
            const float a = gate / (1.f + __expf(-gate)) * up;
            act[m * INTER + (b1 + k) * PAIRS + pair] = to_dtype(a);
        }
    }

    // ---- phase 2's first stages, then every CTA's act ----
    __syncthreads();  // every read of the ring in phase 1 is done
    if (tid == 0) {
        fence_async_shared();
        for (u32 k = 0; k < n2 && k < STAGES2; ++k)
            issue_stage2(ring, smem_u32(bars + STAGES1 + k), w_down, b2 + k, k);
    }
    grid_barrier(sync, next_gen);
    for (int i = tid; i < M_ROWS * CHUNKS2; i += THREADS) sts128(act_s + i * 16, load_cg(act + i * 8));
    __syncthreads();

    // ---- phase 2: down rows ----
    for (u32 k = 0; k < n2; ++k) {
        const u32 slot = k % STAGES2;
        mbar_wait(smem_u32(bars + STAGES1 + slot), (k / STAGES2) & 1);
        const u32 stage = ring + slot * STAGE2_BYTES;
        float acc[DOWN_ROWS][M_ROWS];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M_ROWS; ++m) acc[r][m] = 0.f;
#pragma unroll
        for (int c = 0; c < CPT2; ++c) {
            const int chunk = tid + c * THREADS;
            if (chunk < CHUNKS2) {
                float a[M_ROWS][8];
#pragma unroll
                for (int m = 0; m < M_ROWS; ++m) unpack8(lds128(act_s + (m * CHUNKS2 + chunk) * 16), a[m]);
#pragma unroll
                for (int r = 0; r < DOWN_ROWS; ++r) {
                    const chunk16 w = lds128(stage + r * INTER * 2 + chunk * 16);
#pragma unroll
                    for (int m = 0; m < M_ROWS; ++m) acc[r][m] += dot8(w, a[m]);
                }
            }
        }
        float* p = parts + (k & 1) * (WARPS * ROWS1 * M_ROWS);
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M_ROWS; ++m) {
                const float v = warp_sum(acc[r][m]);
                if (lane == 0) p[(warp * DOWN_ROWS + r) * M_ROWS + m] = v;
            }
        __syncthreads();
        if (tid == 0 && k + STAGES2 < n2) {
            fence_async_shared();
            issue_stage2(ring, smem_u32(bars + STAGES1 + slot), w_down, b2 + k + STAGES2, slot);
        }
        if (tid < DOWN_ROWS * M_ROWS) {
            const int r = tid % DOWN_ROWS, m = tid / DOWN_ROWS;
            out[m * HIDDEN + (b2 + k) * DOWN_ROWS + r] = to_dtype(stage_sum<M_ROWS, DOWN_ROWS>(p, r, m));
        }
    }
#if !EARLY
    pdl_launch_dependents();  // the weights are streamed: the next kernel may take the SMs
#endif
}
