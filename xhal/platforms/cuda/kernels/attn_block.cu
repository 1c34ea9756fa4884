// A decoder layer's attention block for one decode token in one persistent launch (sm_90+):
//
//   residual_out = x + residual                                  (rounded to the dtype)
//   h            = residual_out * norm_w / rms(residual_out)     (fp32, not rounded)
//   qkv          = h @ w_qkv^T                                   (each rounded to the dtype)
//   q, k         = per-head RMSNorm with q_norm_w / k_norm_w     (QK_NORM; rounded)
//   q, k         = rotary(q, k) at position pos                  (rounded: k as the cache holds it)
//   cache[slot]  = k, v                                          (slot -1: not written)
//   attn         = softmax(q k^T * scale) v over keys [0, kv_len) (rounded to the dtype)
//   out          = attn @ w_o^T
//
// One CTA per SM, every CTA resident at once, three phases and two grid barriers:
//   1. the qkv projection: every CTA norms the row (registers) and streams its share of w_qkv
//      rows through a ring of shared-memory stages (TMA bulk copies on mbarriers), storing its
//      rows of qkv (fp32 scratch). Its share of w_o follows in the same ring: the first stages
//      of both are requested before the PDL wait, as many as the ring holds.
//   2. attention, split-KV: CTA i < NUM_KV * SPLITS takes KV head i / SPLITS and a range of
//      keys; its first two K / V tiles are requested (cp.async) before the PDL wait, since past
//      keys and the staged lengths / table never come from the kernel ahead (xhal/platforms/
//      cuda/pdl.py, rule 1). Each CTA norms and rotates its group's queries and the new key itself
//      (a few hundred values), attends over its range with the new token's key and value taken
//      from registers (the split holding position kv_len - 1 also writes them to the cache),
//      and stores its partial (max, sum, unnormalized output) per head. Once every split of its
//      KV head has (an arrival count per head), each merges a slice of the group's outputs.
//      Meanwhile the ring streams w_o rows into the slots phase 1 freed.
//   3. the o projection: every CTA reads attn (registers) and streams its share of w_o rows.
//
// Compile-time (NVRTC -D options, attn_block.py): DTYPE_BF16, HIDDEN, NUM_HEADS, NUM_KV,
// HEAD_DIM, ROT_DIM, NEOX, QK_NORM, SPLITS, PAGE (tokens per cache block), ROWS1 (w_qkv rows per
// stage), ROWS3 (w_o rows per stage), STAGES, SLOT_BYTES (one stage's room), USE_PDL.
// Runtime: pointers, the row strides of x and residual (elements), eps, the q/k-norm eps, the
// softmax scale, the TIMING buffer (unused without it). The helpers are stream_common.cuh's
// (the weight stream) and attn_block_steps.cuh's (the loads, barriers and merge of phase 2).
//
// The barriers' arrival count (`sync`) and the per-KV-head arrival counts (`counters`) are 64-bit,
// zero before the first launch, and only grow (2 * gridDim.x and SPLITS a launch). Launches
// sharing them must not overlap (one stream).

#define THREADS 256
#define WARPS (THREADS / 32)
#include "stream_common.cuh"

#define GROUP (NUM_HEADS / NUM_KV)
#define QKV_ROWS ((NUM_HEADS + 2 * NUM_KV) * HEAD_DIM)
#define HD (NUM_HEADS * HEAD_DIM)          // the o projection's input length
#define CPT1 ((HIDDEN / 8 + THREADS - 1) / THREADS)
#define CPT3 ((HD / 8 + THREADS - 1) / THREADS)
#define UNITS1 (QKV_ROWS / ROWS1)
#define UNITS3 (HIDDEN / ROWS3)
#define ITEMS (NUM_KV * SPLITS)
#define KV_TILE 64                         // keys per K / V tile
#define TILE_BYTES (KV_TILE * HEAD_DIM * 2)
#define CHUNKS_ROW (HEAD_DIM / 8)          // 16-byte chunks of one key's head
#define HEADS2 (GROUP + 1)                 // phase 2's rows: the group's queries, then the new key
#define PER_THREAD ((GROUP * HEAD_DIM + THREADS - 1) / THREADS)  // output values a thread owns
#define MAX_ROWS (ROWS1 > ROWS3 ? ROWS1 : ROWS3)
#define BARS_BYTES 128                     // the mbarriers, ahead of the ring
#define NEG_INF __int_as_float(0xff800000u)

static_assert(NUM_HEADS % NUM_KV == 0, "whole GQA groups");
static_assert(HIDDEN % 8 == 0 && HD % 8 == 0 && HEAD_DIM % 8 == 0, "16-byte chunks");
static_assert(QKV_ROWS % ROWS1 == 0 && HIDDEN % ROWS3 == 0, "whole stages");
static_assert(ROWS1 * HIDDEN * 2 <= SLOT_BYTES && ROWS3 * HD * 2 <= SLOT_BYTES, "stages fit");
static_assert(GROUP <= WARPS, "one warp per head in the softmax update");
static_assert(THREADS % (4 * KV_TILE) == 0 || 4 * KV_TILE == THREADS, "4 threads per key");
static_assert(ROT_DIM % 2 == 0 && ROT_DIM <= HEAD_DIM, "rotary pairs within the head");
static_assert(STAGES * 8 <= BARS_BYTES && SLOT_BYTES % 16 == 0, "the layout's alignment");

#include "attn_block_steps.cuh"  // the loads, barriers and phase-2 steps, by the macros above

// Unit u of this CTA's weight stream into ring slot u % STAGES: its qkv units first (u < n1,
// ROWS1 rows of w_qkv from unit b1), then its o units (ROWS3 rows of w_o from unit b3). Both
// projections share one ring and one sequence of mbarrier uses, so the o rows start streaming
// as soon as a slot is free: before the PDL wait where both shares fit the ring.
__device__ __forceinline__ void issue_unit(u32 ring, u64* bars, const u16* w_qkv, const u16* w_o,
                                           u32 u, u32 n1, u32 b1, u32 b3) {
    const u32 slot = u % STAGES, bar = smem_u32(bars + slot);
    const u16* src;
    u32 bytes;
    if (u < n1) {
        src = w_qkv + (u64)(b1 + u) * ROWS1 * HIDDEN;
        bytes = ROWS1 * HIDDEN * 2;
    } else {
        src = w_o + (u64)(b3 + u - n1) * ROWS3 * HD;
        bytes = ROWS3 * HD * 2;
    }
    mbar_expect(bar, bytes);
    bulk_copy(ring + slot * SLOT_BYTES, src, bytes, bar);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) attn_block(
    const u16* __restrict__ x, const u16* __restrict__ residual, const u16* __restrict__ norm_w,
    const u16* __restrict__ w_qkv, const u16* __restrict__ q_norm_w,
    const u16* __restrict__ k_norm_w, const float* __restrict__ cos_sin,
    const int* __restrict__ positions, u16* k_cache, u16* v_cache,
    const int* __restrict__ block_table, const int* __restrict__ kv_lens,
    const int* __restrict__ slots, const u16* __restrict__ w_o,
    u16* __restrict__ out, u16* __restrict__ residual_out,
    float* qkv, float* partial_acc, float* partial_ml, u16* attn, u64* counters, u64* sync,
    long long x_stride, long long res_stride, float eps, float qk_eps, float scale,
    u64* timing)
{
    // shared memory (attn_block.py's plan sizes it): mbarriers, the weight ring, two K / V tile
    // buffers, then the fp32 scratch of phase 2 and of the stage reductions
    extern __shared__ unsigned char smem[];  // the dynamic base: 16-byte aligned at least
    u64* bars = (u64*)smem;                        // [STAGES]
    const u32 ring = smem_u32(smem + BARS_BYTES);  // [STAGES][SLOT_BYTES]
    const u32 tiles = ring + STAGES * SLOT_BYTES;  // [2 buffers][K, V][KV_TILE][HEAD_DIM]
    float* vals = (float*)(smem + BARS_BYTES + STAGES * SLOT_BYTES + 4 * TILE_BYTES);
    float* scores = vals + HEADS2 * HEAD_DIM;      // vals: [HEADS2][HEAD_DIM]; [GROUP][KV_TILE]
    float* stats = scores + GROUP * KV_TILE;       // m, l, alpha [GROUP]; inverse rms [HEADS2]
    float* parts = stats + 3 * GROUP + HEADS2 + 1; // [2][WARPS][MAX_ROWS]
    float* red = parts + 2 * WARPS * MAX_ROWS;     // [WARPS]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    u32 b1, e1, b3, e3;
    share(UNITS1, &b1, &e1);
    share(UNITS3, &b3, &e3);
    const u32 n1 = e1 - b1, n3 = e3 - b3, units = n1 + n3;

    // this CTA's attention item: KV head g, keys [begin, end) (empty when begin >= end)
    const bool has_item = blockIdx.x < ITEMS;
    const int g = blockIdx.x / SPLITS, split = blockIdx.x % SPLITS;
    const int kv_len = ldcg_i32(kv_lens);  // staged by the host (pdl.py rule 1)
    const int chunk = ((kv_len + SPLITS - 1) / SPLITS + KV_TILE - 1) / KV_TILE * KV_TILE;
    const int begin = split * chunk;
    const int end = imin(kv_len, begin + chunk);
    const bool attends = has_item && begin < end;

    // ---- before the wait: weights, the first tiles of past keys, this position's cos / sin ----
    mark(timing, 0);
    constexpr int ROT_PER = (HEADS2 * HEAD_DIM + THREADS - 1) / THREADS;  // values a thread rotates
    float cos_r[ROT_PER], sin_r[ROT_PER];
    {
        const float* cs = cos_sin + (long long)ldcg_i32(positions) * ROT_DIM;
#pragma unroll
        for (int i = 0; i < ROT_PER; ++i) {
            const int d = (tid + i * THREADS) % HEAD_DIM;
            constexpr int HALF = ROT_DIM / 2;
#if NEOX
            const int f = d < HALF ? d : d - HALF;
#else
            const int f = d / 2;
#endif
            cos_r[i] = d < ROT_DIM && has_item ? cs[f] : 1.f;
            sin_r[i] = d < ROT_DIM && has_item ? cs[HALF + f] : 0.f;
        }
    }
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(bars + s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 u = 0; u < units && u < STAGES; ++u)
            issue_unit(ring, bars, w_qkv, w_o, u, n1, b1, b3);
    }
    // the first two tiles (both buffers): a split of up to 2 * KV_TILE keys is on chip early
    if (attends) {
        load_tile(tiles, tiles + TILE_BYTES, k_cache, v_cache, block_table, begin, end, g);
    }
    cp_async_commit();
    if (attends && begin + KV_TILE < end) {
        load_tile(tiles + 2 * TILE_BYTES, tiles + 3 * TILE_BYTES, k_cache, v_cache, block_table,
                  begin + KV_TILE, end, g);
    }
    cp_async_commit();
    pdl_wait();  // x and residual are the kernel ahead's
    __syncthreads();  // the mbarriers are initialised
    mark(timing, 1);

    // the arrival count before this launch: a multiple of 2 * gridDim.x (the launches before
    // have finished), plus at most the arrivals of this launch's CTAs at the first barrier
    u64 base = 0, group_base = 0;
    if (tid == 0) {
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(base) : "l"(sync) : "memory");
        base -= base % (2ull * gridDim.x);
        if (has_item) {  // likewise the group's count: SPLITS a launch
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];"
                         : "=l"(group_base) : "l"(counters + g) : "memory");
            group_base -= group_base % SPLITS;
        }
    }

    // ---- phase 1: norm, qkv rows ----
    {
        float h[CPT1][1][8];
        load_input<HIDDEN, 1, CPT1, true>(
            h, x, residual, norm_w, residual_out, x_stride, res_stride, eps, blockIdx.x == 0, red);
        for (u32 k = 0; k < n1; ++k) {
            const u32 slot = k % STAGES;
            mbar_wait(smem_u32(bars + slot), (k / STAGES) & 1);
            float* p = parts + (k & 1) * (WARPS * MAX_ROWS);
            stage_dots<HIDDEN, 1, CPT1, ROWS1>(ring + slot * SLOT_BYTES, h, p);
            __syncthreads();  // the stage is read and its parts written
            if (tid == 0 && k + STAGES < units) {
                fence_async_shared();
                issue_unit(ring, bars, w_qkv, w_o, k + STAGES, n1, b1, b3);
            }
            if (tid < ROWS1) {
                qkv[(b1 + k) * ROWS1 + tid] = round_dtype(stage_sum<1, ROWS1>(p, tid, 0));
            }
        }
    }
    mark(timing, 2);
    grid_sync(sync, base + gridDim.x);  // the o rows keep streaming into the ring meanwhile
    mark(timing, 3);

    // ---- phase 2: attention over this CTA's keys ----
    if (has_item) {
        // the group's queries (rows 0..GROUP-1) and the new key (row GROUP): normed, rotated,
        // rounded; queries then scaled
        for (int e = tid; e < HEADS2 * HEAD_DIM; e += THREADS) {
            const int r = e / HEAD_DIM, d = e % HEAD_DIM;
            const int row = r < GROUP ? (g * GROUP + r) * HEAD_DIM : (NUM_HEADS + g) * HEAD_DIM;
            vals[e] = ldcg_f32(qkv + row + d);
        }
        __syncthreads();
#if QK_NORM
        for (int r = warp; r < HEADS2; r += WARPS) {
            float ss = 0.f;
            for (int d = lane; d < HEAD_DIM; d += 32)
                ss = fmaf(vals[r * HEAD_DIM + d], vals[r * HEAD_DIM + d], ss);
            ss = warp_sum(ss);
            if (lane == 0) stats[3 * GROUP + r] = rsqrtf(ss / HEAD_DIM + qk_eps);
        }
        __syncthreads();
        for (int e = tid; e < HEADS2 * HEAD_DIM; e += THREADS) {
            const int r = e / HEAD_DIM, d = e % HEAD_DIM;
            const u16* w = r < GROUP ? q_norm_w : k_norm_w;
            vals[e] = round_dtype(vals[e] * stats[3 * GROUP + r] * lo_f32((u32)w[d]));
        }
        __syncthreads();
#endif
        float rotated[ROT_PER];
#pragma unroll
        for (int i = 0; i < ROT_PER; ++i) {
            const int e = tid + i * THREADS;
            if (e >= HEADS2 * HEAD_DIM) break;
            const int r = e / HEAD_DIM, d = e % HEAD_DIM;
            const float* v = vals + r * HEAD_DIM;
            float o = v[d];
            if (d < ROT_DIM) {
                const float c = cos_r[i], s = sin_r[i];
#if NEOX
                constexpr int HALF = ROT_DIM / 2;
                o = d < HALF ? v[d] * c - v[d + HALF] * s : v[d] * c + v[d - HALF] * s;
#else
                o = (d & 1) ? v[d] * c + v[d - 1] * s : v[d] * c - v[d + 1] * s;
#endif
            }
            rotated[i] = round_dtype(o);
        }
        __syncthreads();  // every rotation read the unrotated values
#pragma unroll
        for (int i = 0; i < ROT_PER; ++i) {
            const int e = tid + i * THREADS;
            if (e >= HEADS2 * HEAD_DIM) break;
            vals[e] = e < GROUP * HEAD_DIM ? rotated[i] * scale : rotated[i];
        }
        // the new token: position kv_len - 1, in the split that holds it
        const int last = kv_len - 1;
        const bool holds_new = begin <= last && last < end;
        const float* v_new_src = qkv + (NUM_HEADS + NUM_KV + g) * HEAD_DIM;
        const int slot = ldcg_i32(slots);
        __syncthreads();
        if (holds_new && slot >= 0) {
            for (int d = tid; d < HEAD_DIM; d += THREADS) {
                const u64 at = ((u64)slot * NUM_KV + g) * HEAD_DIM + d;
                k_cache[at] = to_dtype(vals[GROUP * HEAD_DIM + d]);
                v_cache[at] = to_dtype(ldcg_f32(v_new_src + d));
            }
        }

        float acc[PER_THREAD];
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) acc[i] = 0.f;
        if (tid < GROUP) { stats[tid] = NEG_INF; stats[GROUP + tid] = 0.f; }

        int buf = 0;
        for (int first = begin; first < end; first += KV_TILE, buf ^= 1) {
            const u32 k_tile = tiles + buf * 2 * TILE_BYTES, v_tile = k_tile + TILE_BYTES;
            // tiles in flight: this one and (when it exists) the next, one commit group each
            if (first + KV_TILE < end) cp_async_wait<1>(); else cp_async_wait<0>();
            __syncthreads();  // the tile has landed for every thread
            if (first <= last && last < first + KV_TILE) {  // the new token's key and value
                const int j = last - first;
                for (int d = tid; d < HEAD_DIM; d += THREADS) {
                    const u16 kv = to_dtype(vals[GROUP * HEAD_DIM + d]);
                    const u16 vv = to_dtype(ldcg_f32(v_new_src + d));
                    const u32 at = (j * HEAD_DIM + d) * 2;
                    asm volatile("st.shared.u16 [%0], %1;" :: "r"(k_tile + at), "h"(kv) : "memory");
                    asm volatile("st.shared.u16 [%0], %1;" :: "r"(v_tile + at), "h"(vv) : "memory");
                }
                __syncthreads();
            }
            // scores: 4 threads per key, each a quarter of the head's channels, every query head
            {
                const int j = tid / 4, quarter = tid % 4;
                float dots[GROUP];
#pragma unroll
                for (int r = 0; r < GROUP; ++r) dots[r] = 0.f;
                if (j < KV_TILE) {
#pragma unroll
                    for (int c = 0; c < CHUNKS_ROW / 4 + (CHUNKS_ROW % 4 ? 1 : 0); ++c) {
                        const int chunk = quarter + 4 * c;
                        if (chunk >= CHUNKS_ROW) break;
                        float kf[8];
                        unpack8(lds128(k_tile + (j * HEAD_DIM + chunk * 8) * 2), kf);
#pragma unroll
                        for (int r = 0; r < GROUP; ++r) {
                            const float* q = vals + r * HEAD_DIM + chunk * 8;
#pragma unroll
                            for (int e = 0; e < 8; ++e) dots[r] = fmaf(q[e], kf[e], dots[r]);
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < GROUP; ++r) {
                    float s = dots[r];
                    s += __shfl_xor_sync(0xffffffffu, s, 1);
                    s += __shfl_xor_sync(0xffffffffu, s, 2);
                    if (quarter == 0 && j < KV_TILE)
                        scores[r * KV_TILE + j] = first + j < end ? s : NEG_INF;
                }
            }
            __syncthreads();
            // the online softmax: one warp per query head
            if (warp < GROUP) {
                float* s = scores + warp * KV_TILE;
                float mx = NEG_INF;
                for (int j = lane; j < KV_TILE; j += 32) mx = fmaxf(mx, s[j]);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                const float m_old = stats[warp];
                const float m_new = fmaxf(m_old, mx);  // finite: the tile has a key
                float sum = 0.f;
                for (int j = lane; j < KV_TILE; j += 32) {
                    const float p = __expf(s[j] - m_new);  // masked keys: exp(-inf) = 0
                    s[j] = p;
                    sum += p;
                }
                sum = warp_sum(sum);
                __syncwarp();
                if (lane == 0) {
                    const float alpha = __expf(m_old - m_new);  // 0 on the first tile
                    stats[2 * GROUP + warp] = alpha;
                    stats[GROUP + warp] = stats[GROUP + warp] * alpha + sum;
                    stats[warp] = m_new;
                }
            }
            __syncthreads();
            // the values: thread tid owns output values tid + i * THREADS of [GROUP][HEAD_DIM]
            // (rows past the split's end hold zeros and have p = 0)
#pragma unroll
            for (int i = 0; i < PER_THREAD; ++i) {
                const int e = tid + i * THREADS;
                if (e >= GROUP * HEAD_DIM) break;
                const int r = e / HEAD_DIM, d = e % HEAD_DIM;
                const float* p = scores + r * KV_TILE;
                const u32 v = v_tile + d * 2;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;  // four chains, loads in flight
#pragma unroll 4
                for (int j = 0; j < KV_TILE; j += 4) {
                    a0 = fmaf(p[j], lds_f16(v + (j * HEAD_DIM) * 2), a0);
                    a1 = fmaf(p[j + 1], lds_f16(v + ((j + 1) * HEAD_DIM) * 2), a1);
                    a2 = fmaf(p[j + 2], lds_f16(v + ((j + 2) * HEAD_DIM) * 2), a2);
                    a3 = fmaf(p[j + 3], lds_f16(v + ((j + 3) * HEAD_DIM) * 2), a3);
                }
                acc[i] = acc[i] * stats[2 * GROUP + r] + ((a0 + a1) + (a2 + a3));
            }
            __syncthreads();  // this buffer is free: the tile after next goes into it
            if (first + 2 * KV_TILE < end) {
                load_tile(k_tile, v_tile, k_cache, v_cache, block_table, first + 2 * KV_TILE, end,
                          g);
                cp_async_commit();
            }
        }

        mark(timing, 4);
        // this split's partial (zeros for an empty split, whose weight is 0); the last split of
        // the KV head to finish merges the group
        float* my_acc = partial_acc + (u64)blockIdx.x * GROUP * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int e = tid + i * THREADS;
            if (e < GROUP * HEAD_DIM) my_acc[e] = attends ? acc[i] : 0.f;
        }
        if (tid < GROUP) {
            partial_ml[(blockIdx.x * GROUP + tid) * 2] = attends ? stats[tid] : NEG_INF;
            partial_ml[(blockIdx.x * GROUP + tid) * 2 + 1] = attends ? stats[GROUP + tid] : 0.f;
        }
        // the merge's scratch is the K / V tiles' room: every tile has landed
        merge_group_slice(
            (float*)(smem + BARS_BYTES + STAGES * SLOT_BYTES), partial_ml, partial_acc,
            counters + g, group_base + SPLITS, attn, g, split);
    }
    mark(timing, 5);
    grid_sync(sync, base + 2ull * gridDim.x);
    mark(timing, 6);

    // ---- phase 3: o rows ----
    {
        float a[CPT3][1][8];
        load_input<HD, 1, CPT3, false>(a, attn, nullptr, nullptr, nullptr, 0, 0, 0.f, false, red);
        for (u32 k = 0; k < n3; ++k) {
            const u32 u = n1 + k, slot = u % STAGES;
            mbar_wait(smem_u32(bars + slot), (u / STAGES) & 1);
            float* p = parts + (k & 1) * (WARPS * MAX_ROWS);
            stage_dots<HD, 1, CPT3, ROWS3>(ring + slot * SLOT_BYTES, a, p);
            __syncthreads();
            if (tid == 0 && u + STAGES < units) {
                fence_async_shared();
                issue_unit(ring, bars, w_qkv, w_o, u + STAGES, n1, b1, b3);
            }
            if (tid < ROWS3) out[(b3 + k) * ROWS3 + tid] = to_dtype(stage_sum<1, ROWS3>(p, tid, 0));
        }
    }
    mark(timing, 7);
    pdl_launch_dependents();  // the weights are streamed: the next kernel may take the SMs
}
