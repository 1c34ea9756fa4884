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
// ROUTE=1 builds the other entry, gemv_stream_route: one row's o projection with a
// mixture-of-experts layer's residual add, RMSNorm, router and top-k after it (see there).
//
// Compile-time: DTYPE_BF16, M_ROWS, K, R, STAGES, NORM, USE_PDL, EARLY, ROUTE (and the route's
// own, below). Runtime: pointers, N (rows of w), the row strides of x and residual (elements), eps.
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
#ifndef ROUTE
#define ROUTE 0
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

// The ring's mbarriers initialised and the first stages of this CTA's units [begin, begin +
// units) requested (thread 0; nothing here depends on the kernel ahead)
__device__ __forceinline__ void start_ring(u32 ring, u64* bars, const u16* w, u32 n, u32 begin,
                                           u32 units) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(bars + s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 k = 0; k < units && k < STAGES; ++k) issue(ring, smem_u32(bars + k), w, n, begin + k, k);
    }
}

// This CTA's units streamed through the ring (start_ring requested the first STAGES): each
// stage's dot products with the input rows, reduced over the CTA; then thread r + m * R hands
// the value of weight row (unit * R + r) for input row m to sink(row, m, value).
template <class Sink>
__device__ __forceinline__ void stream_units(u32 ring, u64* bars, float* parts, const u16* w,
                                             u32 n, u32 begin, u32 units,
                                             const float (&in)[CPT][M_ROWS][8], Sink sink) {
    const int tid = threadIdx.x;
    for (u32 k = 0; k < units; ++k) {
        const u32 slot = k % STAGES;
        mbar_wait(smem_u32(bars + slot), (k / STAGES) & 1);
        float* p = parts + (k & 1) * (WARPS * R * M_ROWS);
        // rows past n in a short last unit read stale stage bytes; their sums are never handed on
        stage_dots<K, M_ROWS, CPT, R>(ring + slot * STAGE_BYTES, in, p);
        __syncthreads();  // the stage is read and its parts written
        if (tid == 0 && k + STAGES < units) {
            fence_async_shared();
            issue(ring, smem_u32(bars + slot), w, n, begin + k + STAGES, slot);
        }
        if (tid < R * M_ROWS) {
            const int r = tid % R, m = tid / R;
            const u32 row = (begin + k) * R + r;
            if (row < n) sink(row, m, stage_sum<M_ROWS, R>(p, r, m));
        }
    }
}

#if !ROUTE

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

    u32 begin, end;
    share((n + R - 1) / R, &begin, &end);
    const u32 units = end - begin;

    start_ring(ring, bars, w, n, begin, units);  // weights first
#if EARLY
    pdl_launch_dependents();  // the next kernel may launch beside this one
#endif
    pdl_wait();  // x and residual are the kernel ahead's
    __syncthreads();  // the mbarriers are initialised

    float in[CPT][M_ROWS][8];
    load_input<K, M_ROWS, CPT, NORM != 0>(
        in, x, residual, norm_w, residual_out, x_stride, res_stride, eps, blockIdx.x == 0, red);

    stream_units(ring, bars, parts, w, n, begin, units, in, [&](u32 row, int m, float v) {
        out[(u64)m * n + row] = to_dtype(v);
    });
#if !EARLY
    pdl_launch_dependents();  // the weights are streamed: the next kernel may take the SMs
#endif
}

#else  // ROUTE

// gemv_stream_route: one row's o projection, then a mixture-of-experts layer's post-attention
// residual add, RMSNorm, router GEMV and top-k (DeviceOps.linear_add_rms_norm_moe_route):
//
//   summed = (x @ w^T rounded to the dtype) + residual, rounded   [N]
//   normed = summed / rms(summed) * norm_w, rounded               [N]  (what the experts take)
//   logits = (summed * norm_w) @ gate^T / rms(summed), rounded    [E]  (the normed row unrounded)
//   topk_w, topk_ids: softmax of the logits as stored, the TOP_K largest in descending order
//                     (the lower expert first on ties), renormalized with RENORMALIZE
//
// rms is a sum over the whole row, but the router's dot products are not: a CTA that has its
// rows of summed can add its share of every logit (gate's columns at its rows) and of the sum
// of squares before anyone knows the norm, and 1 / rms scales the sums afterwards. So each CTA
// stores E partial logits and a partial sum of squares, counts itself in, and the last CTA adds
// the partials in CTA order (the same sums every replay), stores the normed row and the logits,
// routes them (softmax_top_k, every thread of it) and zeroes the count for the next launch. The
// router launch and its reload of the row the o GEMV has just written leave the layer's chain.
//
// Compile-time besides the GEMV's (M_ROWS 1, NORM 0): N (rows of w, the hidden size), E
// (experts, a multiple of 4 up to THREADS), TOP_K (up to 32), RENORMALIZE, GRID (the launch's
// CTAs; the last CTA's loops unroll over them) and CTA_ROWS (the most rows a CTA holds, a
// multiple of 4, as R is). Runtime scratch: parts [GRID][E + 4] floats and a zeroed counter.

#define EP (E + 4)  // a CTA's partials: E logits, the sum of squares, 3 floats of padding
// after the mbarriers: rows_s, res_s, sums, probs, squares, scratch, slot_w, slot_id, last + 1
#define ROUTE_FLOATS (2 * CTA_ROWS + WARPS * E + E + 2 * WARPS + 64 + 2)

static_assert(M_ROWS == 1 && NORM == 0, "the route takes one row with no norm ahead of w");
static_assert(R % 4 == 0 && CTA_ROWS % 4 == 0 && N % 8 == 0, "rows go in 8- and 16-byte chunks");
static_assert(E % 4 == 0 && E <= THREADS && TOP_K >= 1 && TOP_K <= 32 && TOP_K <= E, "experts");

struct alignas(8) chunk8 { u32 x, y; };

// an 8-byte load kept after the PDL wait (asm volatile, as load_cg)
__device__ __forceinline__ chunk8 load_cg8(const void* p) {
    chunk8 v;
    asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ float load_cg_f32(const float* p) {
    return __uint_as_float(load_u32_cg(p));
}

__device__ __forceinline__ float load_cg_dtype(const u16* p) {
    u16 v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return lo_f32((u32)v);
}

__device__ __forceinline__ void unpack4(chunk8 c, float* out) {
    out[0] = lo_f32(c.x); out[1] = hi_f32(c.x); out[2] = lo_f32(c.y); out[3] = hi_f32(c.y);
}

// The max or the sum over the CTA of one value a thread, the same in every thread: shuffles in
// each warp, then the warps' results in warp order through scratch [WARPS] (the same sum every
// launch). Every thread of the CTA calls it.
template <bool Max>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = Max ? fmaxf(v, other) : v + other;
    }
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = scratch[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) t = Max ? fmaxf(t, scratch[w]) : t + scratch[w];
    __syncthreads();  // scratch is free again
    return t;
}

// The routing of the logits, one an expert thread (tid < E; -inf in the others), by the whole
// CTA: the softmax, then each expert's rank among the probabilities (how many are larger, or
// equal at a lower index); the experts ranked under TOP_K fill the slots in rank order, the
// weights divided by their sum with RENORMALIZE. One warp taking the largest TOP_K times in a
// row costs TOP_K chains of shuffles; the ranks are E compares a thread, side by side.
__device__ __forceinline__ void softmax_top_k(float logit, float* probs, float* scratch,
                                              float* slot_w, int* slot_id, float* topk_w,
                                              int* topk_ids) {
    const int tid = threadIdx.x, lane = tid & 31;
    const float top = block_reduce<true>(logit, scratch);
    const float e = tid < E ? expf(logit - top) : 0.f;
    const float p = e / block_reduce<false>(e, scratch);
    if (tid < E) probs[tid] = p;
    __syncthreads();
    if (tid < E) {
        int rank = 0;
#pragma unroll 8
        for (int j = 0; j < E; ++j) {
            const float q = probs[j];
            rank += q > p || (q == p && j < tid);
        }
        if (rank < TOP_K) { slot_w[rank] = p; slot_id[rank] = tid; }
    }
    __syncthreads();
    if (tid < 32) {
        const float w = lane < TOP_K ? slot_w[lane] : 0.f;
        const float picked = RENORMALIZE ? warp_sum(w) : 1.f;
        if (lane < TOP_K) {
            topk_w[lane] = RENORMALIZE ? w / picked : w;
            topk_ids[lane] = slot_id[lane];
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) gemv_stream_route(
    const u16* __restrict__ x, const u16* __restrict__ w, const u16* __restrict__ residual,
    const u16* __restrict__ norm_w, const u16* __restrict__ gate, u16* __restrict__ summed,
    u16* __restrict__ normed, u16* __restrict__ logits, float* __restrict__ topk_w,
    int* __restrict__ topk_ids, float* __restrict__ parts_g, u32* __restrict__ counter, float eps
#if TIMING
    , u64* __restrict__ timing  // [GRID][8]: the marks below (benchmarks/bench_o_route.py)
#endif
    )
{
    extern __shared__ unsigned char smem[];
    float* parts = (float*)(smem + STAGES * STAGE_BYTES);
    u64* bars = (u64*)(parts + PARTS_FLOATS + WARPS);  // (the GEMV's norm sums go unused)
    float* rows_s = (float*)(bars + STAGES);  // [CTA_ROWS] this CTA's rows of summed (0 past them)
    float* res_s = rows_s + CTA_ROWS;         // [CTA_ROWS] the residual at those rows
    float* sums = res_s + CTA_ROWS;           // [WARPS][E] the last CTA's partial logits a warp
    float* probs = sums + WARPS * E;          // [E] the routing's probabilities
    float* squares = probs + E;               // [WARPS] the last CTA's sums of squares a warp
    float* scratch = squares + WARPS;         // [WARPS] the routing's block reductions
    float* slot_w = scratch + WARPS;          // [32] the routing's picks, in rank order
    int* slot_id = (int*)(slot_w + 32);       // [32]
    u32* last = (u32*)(slot_id + 32);         // whether this CTA counted in last
    const u32 ring = smem_u32(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#if !TIMING
    u64* timing = nullptr;  // mark() stores nothing
#endif

    u32 begin, end;
    share((N + R - 1) / R, &begin, &end);
    const u32 units = end - begin, row0 = begin * R;
    const u32 rows = (end * R < N ? end * R : N) - row0;

    mark(timing, 0);  // started
    start_ring(ring, bars, w, N, begin, units);
#if EARLY
    pdl_launch_dependents();
#endif
    pdl_wait();  // x and residual are the kernels ahead's; the scratch their launches' too
    mark(timing, 1);  // waited
    // the residual, gate's and norm_w's columns at this CTA's rows: they land while w streams
    if (tid < CTA_ROWS) {
        res_s[tid] = tid < rows ? load_cg_dtype(residual + row0 + tid) : 0.f;
        rows_s[tid] = 0.f;
    }
    chunk8 g[CTA_ROWS / 4], nw[CTA_ROWS / 4];
#pragma unroll
    for (int c = 0; c < CTA_ROWS / 4; ++c) {
        const bool here = tid < E && 4 * c < rows;
        g[c] = here ? load_cg8(gate + (u64)tid * N + row0 + 4 * c) : chunk8{0, 0};
        nw[c] = here ? load_cg8(norm_w + row0 + 4 * c) : chunk8{0, 0};
    }
    __syncthreads();  // the mbarriers are initialised, res_s and rows_s written

    float in[CPT][1][8];
    load_input<K, 1, CPT, false>(in, x, nullptr, nullptr, nullptr, K, 0, 0.f, false, nullptr);

    stream_units(ring, bars, parts, w, N, begin, units, in, [&](u32 row, int, float v) {
        // o as the GEMV stores it, then the residual stream's add in the dtype
        const float s = round_dtype(round_dtype(v) + res_s[row - row0]);
        summed[row] = to_dtype(s);
        rows_s[row - row0] = s;
    });
#if !EARLY
    pdl_launch_dependents();
#endif
    __syncthreads();  // rows_s holds every row of this CTA
    mark(timing, 2);  // streamed

    float* mine = parts_g + (u64)blockIdx.x * EP;
    if (warp == 0) {
        float q = 0.f;
        for (int i = lane; i < CTA_ROWS; i += 32) q = fmaf(rows_s[i], rows_s[i], q);
        q = warp_sum(q);
        if (lane == 0) mine[E] = q;
    }
    if (tid < E) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < CTA_ROWS / 4; ++c) {
            float a[4], b[4];
            unpack4(g[c], a);
            unpack4(nw[c], b);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc = fmaf(a[j] * b[j], rows_s[4 * c + j], acc);
        }
        mine[tid] = acc;
    }
    // count in: every CTA's partials before its count, the last CTA's reads after every count
    __syncthreads();
    mark(timing, 3);  // partials stored
    if (tid == 0) {  // release: the CTA's partials (ordered before by the barrier) before the
        // count; acquire: the last CTA's reads after every other count
        u32 arrived;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(counter) : "memory");
        *last = arrived == GRID - 1;
    }
    __syncthreads();
    mark(timing, 4);  // counted
    if (!*last) return;

    // the last CTA: summed's chunks and norm_w's for the normed row, in flight with the partials
    constexpr int ROW_CHUNKS = (N / 8 + THREADS - 1) / THREADS;
    chunk16 sv[ROW_CHUNKS], gv[ROW_CHUNKS];
#pragma unroll
    for (int i = 0; i < ROW_CHUNKS; ++i) {
        const int c = tid + i * THREADS;
        if (c < N / 8) { sv[i] = load_cg(summed + c * 8); gv[i] = load_cg(norm_w + c * 8); }
    }
    // warp w adds CTAs w, w + WARPS, ... in order, lane l columns 4l.. of the logits; lane l
    // also loads the sums of squares of the warp's CTAs l, l + 32, ... Every load is issued
    // before the first add: in a loop that adds as it loads, each load waited for the one before
    // (the loads are strong, and kept in order), which cost 17 L2 round trips
    constexpr int COLS = E / 4, PER_LANE = (COLS + 31) / 32, PER_WARP = (GRID + WARPS - 1) / WARPS;
    constexpr int SQ_PER_LANE = (PER_WARP + 31) / 32;
    chunk16 pv[PER_WARP][PER_LANE];
    float qv[SQ_PER_LANE];
#pragma unroll
    for (int c = 0; c < PER_WARP; ++c) {
        const int cta = warp + c * WARPS;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int col = lane + 32 * i;
            const bool here = cta < GRID && col < COLS;
            pv[c][i] = here ? load_cg(parts_g + (u64)cta * EP + 4 * col) : chunk16{0, 0, 0, 0};
        }
    }
#pragma unroll
    for (int j = 0; j < SQ_PER_LANE; ++j) {
        const int c = lane + 32 * j, cta = warp + c * WARPS;
        qv[j] = c < PER_WARP && cta < GRID ? load_cg_f32(parts_g + (u64)cta * EP + E) : 0.f;
    }
    float acc[PER_LANE][4];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int c = 0; c < PER_WARP; ++c) {
            acc[i][0] += __uint_as_float(pv[c][i].x);
            acc[i][1] += __uint_as_float(pv[c][i].y);
            acc[i][2] += __uint_as_float(pv[c][i].z);
            acc[i][3] += __uint_as_float(pv[c][i].w);
        }
    }
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < SQ_PER_LANE; ++j) q += qv[j];
    q = warp_sum(q);
    if (lane == 0) squares[warp] = q;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int col = lane + 32 * i;
        if (col < COLS)
#pragma unroll
            for (int j = 0; j < 4; ++j) sums[warp * E + 4 * col + j] = acc[i][j];
    }
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) total += squares[v];
    const float inv = rsqrtf(total / N + eps);
    float logit = __int_as_float(0xff800000);  // -inf past the experts
    if (tid < E) {
        float l = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) l += sums[v * E + tid];
        const u16 stored = to_dtype(l * inv);
        logits[tid] = stored;
        logit = lo_f32((u32)stored);  // the routing takes the logits as stored
    }
#pragma unroll
    for (int i = 0; i < ROW_CHUNKS; ++i) {
        const int c = tid + i * THREADS;
        if (c >= N / 8) continue;
        float s[8], nwv[8];
        unpack8(sv[i], s);
        unpack8(gv[i], nwv);
        u32 packed[4];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const u16 v = to_dtype(s[e] * inv * nwv[e]);  // as rms_norm stores it
            if (e & 1) packed[e >> 1] |= ((u32)v) << 16; else packed[e >> 1] = v;
        }
        chunk16 out;
        out.x = packed[0]; out.y = packed[1]; out.z = packed[2]; out.w = packed[3];
        *(chunk16*)(normed + c * 8) = out;
    }
    mark(timing, 5);  // summed, normed
    softmax_top_k(logit, probs, scratch, slot_w, slot_id, topk_w, topk_ids);
    if (tid == 0) asm volatile("st.relaxed.gpu.u32 [%0], 0;" :: "l"(counter) : "memory");
    mark(timing, 6);  // routed
}

#endif  // ROUTE
