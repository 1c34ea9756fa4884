// A decode token's routed experts in one persistent launch (sm_90+): DeviceOps.moe_experts for
// one token,
//
//   g_j, u_j = w13[e_j] @ x          (fp32, not rounded: moe_small.py's gate-up kernel)
//   act_j    = silu(g_j) * u_j       (rounded to the dtype)
//   out      = sum_j weight_j * (w2[e_j] @ act_j)   (fp32, rounded once)
//
// over the token's TOP_K experts e_j = topk_ids[j] with routing weights weight_j. One CTA per SM,
// every CTA resident at once (the grid is the SM count and one CTA fills an SM's shared memory).
// Phase 1 streams the k experts' gate/up rows, a unit being PAIRS gate rows of one expert with
// their PAIRS up rows; phase 2 streams w2, a unit being DOWN_ROWS output rows, read once per
// expert, so that the combine is a sum in registers (no atomics, no partial buffer). One grid
// barrier between them: the down rows need every act value. Unlike the dense MLP block, no
// weight is known before the wait for the kernel ahead (the router writes the ids), so only the
// CTAs' start and the mbarriers' set-up overlap it; the first phase-2 stages are requested
// before the grid barrier as there. Weights move by TMA bulk copies (cp.async.bulk) into a ring
// of shared-memory stages completed on mbarriers; the threads only read shared memory.
//
// The helpers are stream_common.cuh's. Compile-time shape (NVRTC -D options, see moe_block.py):
// DTYPE_BF16 (else fp16), HIDDEN, INTER (the per-rank expert intermediate size), TOP_K, PAIRS,
// DOWN_ROWS, STAGES1, STAGES2, USE_PDL; for benchmarks TIMING (stream_common.cuh) and LATE_DOWN
// (below). Runtime: the pointers, x's row stride (elements) and the TIMING buffer (unused without
// it).
//
// Sync words (sync[0] arrivals, sync[1] generation) are zero before the first launch and are
// left ready for the next one; launches sharing them must not overlap (one stream).

#define THREADS 256
#define WARPS (THREADS / 32)

#include "stream_common.cuh"

#ifndef LATE_DOWN  // 1: the first phase-2 stages requested after the grid barrier (a benchmark's
#define LATE_DOWN 0  // peer; measured slower: the stream in flight is not what slows the barrier)
#endif

#define CHUNKS2 (INTER / 8)    // 16-byte chunks of an intermediate-sized row
#define CPT1 ((HIDDEN / 8 + THREADS - 1) / THREADS)
#define CPT2 ((CHUNKS2 + THREADS - 1) / THREADS)
#define ROWS1 (2 * PAIRS)      // rows of a phase-1 stage: PAIRS gate rows, then PAIRS up rows
#define UNITS1 (INTER / PAIRS)  // phase-1 units of one expert
#define STAGE1_BYTES (ROWS1 * HIDDEN * 2)
#define STAGE2_BYTES (DOWN_ROWS * INTER * 2)
#define RING1 (STAGES1 * STAGE1_BYTES)
#define RING2 (STAGES2 * STAGE2_BYTES)
#define RING_BYTES (RING1 > RING2 ? RING1 : RING2)  // the phases take turns in one ring
#define ACT_BYTES (TOP_K * INTER * 2)
#define PART_ROWS (ROWS1 > DOWN_ROWS ? ROWS1 : DOWN_ROWS)
#define PARTS_FLOATS (2 * WARPS * PART_ROWS)  // two buffers of per-warp partial sums

static_assert(HIDDEN % 8 == 0 && INTER % 8 == 0, "rows are read in 16-byte chunks");
static_assert(INTER % PAIRS == 0 && HIDDEN % DOWN_ROWS == 0, "whole stages");
static_assert(TOP_K <= THREADS, "one thread loads each routing entry");

// phase-1 unit u of the grid's TOP_K * UNITS1: PAIRS gate rows of expert e = expert_s[u / UNITS1]
// (pair block u % UNITS1) and their PAIRS up rows (w13[e]: gate rows, then up rows)
__device__ __forceinline__ void issue_stage1(
    u32 ring, u32 bar, const u16* w13, const u32* expert_s, u32 u, u32 slot)
{
    const u32 half = PAIRS * HIDDEN * 2;
    const u32 e = expert_s[u / UNITS1], unit = u % UNITS1;
    const u16* base = w13 + (u64)e * (2ull * INTER * HIDDEN);
    const u16* gate = base + (u64)unit * PAIRS * HIDDEN;
    const u16* up = base + ((u64)INTER + (u64)unit * PAIRS) * HIDDEN;
    u32 dst = ring + slot * STAGE1_BYTES;
    mbar_expect(bar, 2 * half);
    bulk_copy(dst, gate, half, bar);
    bulk_copy(dst + half, up, half, bar);
}

// this CTA's phase-2 stage s: the DOWN_ROWS rows of row block b2 + s / TOP_K of w2[e], e the
// token's expert s % TOP_K (w2[e]: [HIDDEN, INTER])
__device__ __forceinline__ void issue_stage2(
    u32 ring, u32 bar, const u16* w2, const u32* expert_s, u32 b2, u32 s, u32 slot)
{
    const u32 e = expert_s[s % TOP_K], unit = b2 + s / TOP_K;
    const u16* rows = w2 + (u64)e * ((u64)HIDDEN * INTER) + (u64)unit * DOWN_ROWS * INTER;
    mbar_expect(bar, STAGE2_BYTES);
    bulk_copy(ring + slot * STAGE2_BYTES, rows, STAGE2_BYTES, bar);
}

// the first STAGES2 of this CTA's n2 phase-2 stages, into slots 0.. (thread 0)
__device__ __forceinline__ void issue_first_stages2(
    u32 ring, const u64* bars2, const u16* w2, const u32* expert_s, u32 b2, u32 n2)
{
    fence_async_shared();
    for (u32 s = 0; s < n2 && s < STAGES2; ++s)
        issue_stage2(ring, smem_u32(bars2 + s), w2, expert_s, b2, s, s);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_block(
    const u16* __restrict__ x, const u16* __restrict__ w13, const u16* __restrict__ w2,
    const float* __restrict__ topk_weights, const int* __restrict__ topk_ids,
    u16* __restrict__ out, u16* __restrict__ act, u32* sync, long long x_stride, u64* timing)
{
    extern __shared__ unsigned char smem[];  // the dynamic base: 16-byte aligned at least
    unsigned char* ring_p = smem;
    unsigned char* act_p = smem + RING_BYTES;
    float* parts = (float*)(act_p + ACT_BYTES);
    float* weight_s = parts + PARTS_FLOATS;           // [TOP_K] routing weights
    u32* expert_s = (u32*)(weight_s + TOP_K);         // [TOP_K] expert ids
    u64* bars = (u64*)(((size_t)(expert_s + TOP_K) + 7) & ~(size_t)7);  // STAGES1, STAGES2
    const u32 ring = smem_u32(ring_p);
    const u32 act_s = smem_u32(act_p);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    u32 b1, e1, b2, e2;
    share(TOP_K * UNITS1, &b1, &e1);  // unit u: expert u / UNITS1, its pair block u % UNITS1
    share(HIDDEN / DOWN_ROWS, &b2, &e2);
    const u32 n1 = e1 - b1, n2 = (e2 - b2) * TOP_K;  // phase-2 stage s: row block b2 + s / TOP_K,
                                                     // expert s % TOP_K

    mark(timing, 0);
    if (tid == 0) {
        for (int s = 0; s < STAGES1 + STAGES2; ++s) mbar_init(smem_u32(bars + s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    pdl_wait();  // x and the routing are the kernels' ahead
    if (tid < TOP_K) {
        weight_s[tid] = __uint_as_float(load_u32_cg(topk_weights + tid));  // never above the
        expert_s[tid] = load_u32_cg(topk_ids + tid);                        // wait (the helper)
    }
    __syncthreads();  // the mbarriers are initialised and the routing is in shared memory
    mark(timing, 1);
    if (tid == 0) {
        for (u32 k = 0; k < n1 && k < STAGES1; ++k)
            issue_stage1(ring, smem_u32(bars + k), w13, expert_s, b1 + k, k);
    }

    u32 next_gen = 0;
    if (tid == 0) {
        asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(next_gen) : "l"(sync + 1) : "memory");
        next_gen += 1;
    }

    float h[CPT1][1][8];  // x, in registers
    load_input<HIDDEN, 1, CPT1, false>(
        h, x, nullptr, nullptr, nullptr, x_stride, 0, 0.f, false, nullptr);

    // ---- phase 1: gate/up rows, SiLU gate, act to global ----
    for (u32 k = 0; k < n1; ++k) {
        const u32 slot = k % STAGES1;
        mbar_wait(smem_u32(bars + slot), (k / STAGES1) & 1);
        float* p = parts + (k & 1) * (WARPS * PART_ROWS);
        stage_dots<HIDDEN, 1, CPT1, ROWS1>(ring + slot * STAGE1_BYTES, h, p);
        __syncthreads();  // the stage is read and its parts written
        if (tid == 0 && k + STAGES1 < n1) {
            fence_async_shared();
            issue_stage1(ring, smem_u32(bars + slot), w13, expert_s, b1 + k + STAGES1, slot);
        }
        if (tid < PAIRS) {
            const u32 u = b1 + k;
            const float gate = stage_sum<1, ROWS1>(p, tid, 0);
            const float up = stage_sum<1, ROWS1>(p, PAIRS + tid, 0);
            const float a = gate / (1.f + __expf(-gate)) * up;
            act[(u / UNITS1) * INTER + (u % UNITS1) * PAIRS + tid] = to_dtype(a);
        }
    }

    // ---- phase 2's first stages (before the barrier unless LATE_DOWN), then every CTA's act ----
    __syncthreads();  // every read of the ring in phase 1 is done
    mark(timing, 2);
    if (tid == 0 && !LATE_DOWN) issue_first_stages2(ring, bars + STAGES1, w2, expert_s, b2, n2);
    grid_barrier(sync, next_gen);
    if (tid == 0 && LATE_DOWN) issue_first_stages2(ring, bars + STAGES1, w2, expert_s, b2, n2);
    mark(timing, 3);
    for (int i = tid; i < TOP_K * CHUNKS2; i += THREADS) sts128(act_s + i * 16, load_cg(act + i * 8));
    __syncthreads();
    mark(timing, 4);

    // ---- phase 2: down rows, each row block's experts in turn, combined in registers ----
    float acc[DOWN_ROWS];
#pragma unroll
    for (int r = 0; r < DOWN_ROWS; ++r) acc[r] = 0.f;
    for (u32 s = 0; s < n2; ++s) {
        const u32 slot = s % STAGES2, j = s % TOP_K, block = s / TOP_K;
        mbar_wait(smem_u32(bars + STAGES1 + slot), (s / STAGES2) & 1);
        const u32 stage = ring + slot * STAGE2_BYTES;
        float dots[DOWN_ROWS];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r) dots[r] = 0.f;
#pragma unroll
        for (int c = 0; c < CPT2; ++c) {
            const int chunk = tid + c * THREADS;
            if (chunk < CHUNKS2) {
                float a[8];
                unpack8(lds128(act_s + (j * CHUNKS2 + chunk) * 16), a);
#pragma unroll
                for (int r = 0; r < DOWN_ROWS; ++r)
                    dots[r] += dot8(lds128(stage + r * INTER * 2 + chunk * 16), a);
            }
        }
        const float w = weight_s[j];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; ++r) acc[r] = fmaf(w, dots[r], acc[r]);
        float* p = parts + (block & 1) * (WARPS * PART_ROWS);
        const bool last = j == TOP_K - 1;
        if (last) {
#pragma unroll
            for (int r = 0; r < DOWN_ROWS; ++r) {
                const float v = warp_sum(acc[r]);
                if (lane == 0) p[warp * DOWN_ROWS + r] = v;
                acc[r] = 0.f;
            }
        }
        __syncthreads();  // the stage is read (and a row block's parts written)
        if (tid == 0 && s + STAGES2 < n2) {
            fence_async_shared();
            issue_stage2(ring, smem_u32(bars + STAGES1 + slot), w2, expert_s, b2, s + STAGES2, slot);
        }
        if (last && tid < DOWN_ROWS)
            out[(b2 + block) * DOWN_ROWS + tid] = to_dtype(stage_sum<1, DOWN_ROWS>(p, tid, 0));
    }
    mark(timing, 5);
    pdl_launch_dependents();  // the weights are streamed: the next kernel may take the SMs
}
