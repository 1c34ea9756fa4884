// A skinny GEMM on the tensor cores (sm_90+): out[m, n] = x[m, :] . w[n, :] for the 2 to 64
// rows of a decode batch, where a projection's cost is streaming its weight, not its FLOPs.
//
// A cluster of KS CTAs owns BN weight rows; CTA r of the cluster takes the r-th of KS ranges of K
// (whole 64-column chunks, as even as the chunks allow). Each streams its [BN, K / KS] slice of w
// and the matching [MT, K / KS] slice of x through a ring of STAGES stages of 64 columns, both
// tiles placed by TMA (tensor maps, 128-byte swizzle), and multiplies them with mma.sync m16n8k16
// (each warp WR weight rows against the MT input rows, operands by ldmatrix). The cluster then
// sums its KS fp32 partial tiles in rank order through distributed shared memory (no global
// partials, no second launch, the same sum every run) and each CTA stores a 1 / KS share of the
// columns (whole float4s, as even as they allow: KS need not divide BN).
//
// Why this shape: at 64 rows a projection reads its weight once and x once per block of BN
// weight rows (M / BN of the weight's bytes through L2), so blocks are wide; a wide block leaves
// too few blocks to fill the SMs, so K is split, and the split's partials stay on chip. A
// cluster's CTAs share a GPC, so a launch takes no more clusters than the GPCs hold at once
// (skinny_mma.py, plan): one more would run alone in a second wave, on one GPC's bandwidth.
//
// Before the programmatic-dependent-launch wait a CTA only initialises its mbarriers and requests
// the weight tiles of its first stages (pdl.py, rule 1); x, written by the kernel ahead, comes
// after it. The next kernel may launch once the weight stream is done (late: gated).
//
// WGMMA=1 (sm_90a) multiplies with wgmma instead: each warpgroup's four warps take 64 weight rows
// (WR = 16) and one m64nMTk16 per 16 columns reads both tiles from shared memory through
// descriptors of the 128-byte swizzle, with no ldmatrix; the accumulators land as mma.sync's do.
//
// Compile-time: DTYPE_BF16, MT (input rows of the tile, a multiple of 16), WR (weight rows a
// warp, a multiple of 16), WARPS, KS (the cluster), STAGES, USE_PDL, WGMMA. Runtime: the two
// tensor maps (w as [n, K] with a box of [BN / WBOXES, 64], x as [m, K] with a box of [MT, 64];
// 128-byte swizzle, zero fill), out, n, m, the 64-column chunks of K, out's row stride.

#define THREADS (WARPS * 32)
#ifndef WGMMA
#define WGMMA 0
#endif

#include "stream_common.cuh"

#define BN (WR * WARPS)                 // weight rows of a cluster
#define WBOXES ((BN + 255) / 256)       // a TMA box is at most 256 rows
#define WBOX_ROWS (BN / WBOXES)
#define W_BYTES (BN * 128)              // a stage's weight tile: BN rows of 64 columns
#define X_BYTES (MT * 128)
#define STAGE_BYTES (W_BYTES + X_BYTES)
#define PSTRIDE (BN + 4)                // floats a row of the partial tile (bank-conflict free)
#define QUADS (BN / 4)                  // the partial tile's float4 columns, shared over the cluster

static_assert(MT % 16 == 0 && MT <= 64, "input rows come in ldmatrix.x4 pairs of n8 tiles");
static_assert(WR % 16 == 0, "a warp's weight rows are m16 tiles");
static_assert(BN % 32 == 0, "the partial tile's stride keeps the stores conflict free");
static_assert(WBOX_ROWS * WBOXES == BN && WBOX_ROWS % 8 == 0, "boxes of whole swizzle atoms");
static_assert(KS >= 1 && KS <= 8 && QUADS >= KS, "a portable cluster, each CTA a column share");
static_assert(!WGMMA || (WR == 16 && WARPS % 4 == 0), "a warpgroup takes 64 weight rows");

// a TMA tensor map, passed by value (__grid_constant__), 64-byte aligned
struct alignas(64) TmaMap { u64 words[16]; };
struct f32x4 { float x, y, z, w; };

__device__ __forceinline__ void tma_tile(u32 dst, const TmaMap* map, int col, int row, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"((u64)map), "r"(col), "r"(row), "r"(bar) : "memory");
}

// the byte address of 16-byte chunk `chunk` (0-7) of row `row` in a tile TMA wrote with the
// 128-byte swizzle: a row's chunks are permuted by the row's index within its 8-row atom
__device__ __forceinline__ u32 swizzled(u32 tile, u32 row, u32 chunk) {
    return tile + row * 128 + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a (16 weight rows x 16 columns) . b (16 columns x 8 input rows), fp32
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if DTYPE_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cluster_sync() {
#if KS > 1
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

#if WGMMA
// a shared-memory matrix descriptor of a K-major tile TMA wrote with the 128-byte swizzle: rows
// of 128 bytes, 8-row atoms 1024 bytes apart (the stride offset); the leading offset is unused
// with this swizzle; 16 columns further along K is 32 bytes further on the start address
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32)
           | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_and_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

#if DTYPE_BF16
#define WG_TYPES ".f32.bf16.bf16"
#else
#define WG_TYPES ".f32.f16.f16"
#endif
#define WG_TAIL "p, 1, 1, 0, 0;\n}"
#define WG_HEAD(n) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #n "k16" WG_TYPES " "
#define F4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])

// d (this thread's share of 64 weight rows x MT input rows, fp32) += a-tile . b-tile^T over 16
// columns; d[j] is n8 tile j, laid out as mma.sync's m16n8 accumulator of the warp's 16 rows
__device__ __forceinline__ void wgmma_step(float (&d)[MT / 8][4], u64 a, u64 b) {
#if MT == 16
    asm volatile(WG_HEAD(16) "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, " WG_TAIL
                 : F4(0), F4(1) : "l"(a), "l"(b));
#elif MT == 32
    asm volatile(WG_HEAD(32) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13,"
                 " %14, %15}, %16, %17, " WG_TAIL
                 : F4(0), F4(1), F4(2), F4(3) : "l"(a), "l"(b));
#elif MT == 48
    asm volatile(WG_HEAD(48) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13,"
                 " %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, " WG_TAIL
                 : F4(0), F4(1), F4(2), F4(3), F4(4), F4(5) : "l"(a), "l"(b));
#else
    asm volatile(WG_HEAD(64) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13,"
                 " %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28,"
                 " %29, %30, %31}, %32, %33, " WG_TAIL
                 : F4(0), F4(1), F4(2), F4(3), F4(4), F4(5), F4(6), F4(7) : "l"(a), "l"(b));
#endif
}
#endif

// four floats at the same shared-memory offset in the cluster's CTA `rank`
__device__ __forceinline__ f32x4 load_peer(u32 local, u32 rank) {
    f32x4 v;
#if KS > 1
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
#else
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(local) : "memory");
#endif
    return v;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) skinny_mma(
    const __grid_constant__ TmaMap wmap, const __grid_constant__ TmaMap xmap,
    u16* __restrict__ out, u32 n, u32 m, u32 kchunks, long long out_stride)
{
    extern __shared__ unsigned char smem_raw[];
    // the swizzle is a function of the address: stages start on 1024 bytes (the launcher adds 1 KB)
    const u32 raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    float* part = (float*)(smem_raw + (base - raw));  // [MT][PSTRIDE], over the ring once read
    constexpr u32 RING = STAGES * STAGE_BYTES, PART = MT * PSTRIDE * 4;
    const u32 bars = base + (RING > PART ? RING : PART);  // STAGES mbarriers
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 rank = blockIdx.x % KS, row0 = (blockIdx.x / KS) * BN;
    const u32 first = rank * kchunks / KS, steps = (rank + 1) * kchunks / KS - first;

    if (tid == 0) {  // the weight tiles first: nothing here depends on the kernel ahead
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (u32 k = 0; k < steps && k < STAGES; ++k) {
            mbar_expect(bars + 8 * k, STAGE_BYTES);  // TMA counts a box's zero-filled rows too
            for (int b = 0; b < WBOXES; ++b)
                tma_tile(base + k * STAGE_BYTES + b * WBOX_ROWS * 128, &wmap, (first + k) * 64,
                         row0 + b * WBOX_ROWS, bars + 8 * k);
        }
    }
    pdl_wait();  // x is the kernel ahead's
    if (tid == 0)
        for (u32 k = 0; k < steps && k < STAGES; ++k)
            tma_tile(base + k * STAGE_BYTES + W_BYTES, &xmap, (first + k) * 64, 0, bars + 8 * k);
    __syncthreads();  // the mbarriers are initialised

    float acc[WR / 16][MT / 8][4];
#pragma unroll
    for (int i = 0; i < WR / 16; ++i)
#pragma unroll
        for (int j = 0; j < MT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#if !WGMMA
    // ldmatrix.x4 rows: the weight's four 8x8 matrices are a0-a3 of an m16 tile (rows lane % 16,
    // columns 8 * (lane / 16)); x's are b0, b1 of two n8 tiles (rows lane % 8 + 8 * (lane / 16),
    // columns 8 * (lane / 8 % 2))
    const u32 a_row = warp * WR + (lane & 15), a_chunk = lane >> 4;
    const u32 b_row = (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
#endif

    for (u32 k = 0; k < steps; ++k) {
        const u32 slot = k % STAGES;
        mbar_wait(bars + 8 * slot, (k / STAGES) & 1);
        const u32 wt = base + slot * STAGE_BYTES, xt = wt + W_BYTES;
#if WGMMA
        wgmma_fence();  // the accumulators' registers are the asynchronous MMAs' from here
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)  // the stage's four 16-column steps
            wgmma_step(acc[0], smem_desc(wt + (warp / 4) * 64 * 128 + kk * 32),
                       smem_desc(xt + kk * 32));
        wgmma_commit_and_wait();  // the stage is read
#else
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {  // the stage's four 16-column steps
            u32 a[WR / 16][4], b[MT / 8][2];
#pragma unroll
            for (int i = 0; i < WR / 16; ++i)
                ldmatrix_x4(a[i], swizzled(wt, a_row + i * 16, 2 * kk + a_chunk));
#pragma unroll
            for (int j = 0; j < MT / 16; ++j) {
                u32 r[4];
                ldmatrix_x4(r, swizzled(xt, b_row + j * 16, 2 * kk + b_chunk));
                b[2 * j][0] = r[0]; b[2 * j][1] = r[1];
                b[2 * j + 1][0] = r[2]; b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < WR / 16; ++i)
#pragma unroll
                for (int j = 0; j < MT / 8; ++j) mma16816(acc[i][j], a[i], b[j][0], b[j][1]);
        }
#endif
        __syncthreads();  // every warp has read the stage
        if (tid == 0 && k + STAGES < steps) {
            fence_async_shared();
            const u32 next = first + k + STAGES;
            mbar_expect(bars + 8 * slot, STAGE_BYTES);
            for (int b = 0; b < WBOXES; ++b)
                tma_tile(wt + b * WBOX_ROWS * 128, &wmap, next * 64, row0 + b * WBOX_ROWS,
                         bars + 8 * slot);
            tma_tile(xt, &xmap, next * 64, 0, bars + 8 * slot);
        }
    }
    pdl_launch_dependents();  // the weights are streamed

    // the partial tile, [input row][weight row]: accumulator e of tile (i, j) is weight row
    // lane / 4 (+ 8 for e >= 2), input row 2 * (lane % 4) (+ 1 for odd e)
#pragma unroll
    for (int i = 0; i < WR / 16; ++i)
#pragma unroll
        for (int j = 0; j < MT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 r = warp * WR + i * 16 + (lane >> 2) + ((e >> 1) << 3);
                const u32 c = j * 8 + 2 * (lane & 3) + (e & 1);
                part[c * PSTRIDE + r] = acc[i][j][e];
            }
    cluster_sync();  // every CTA's partial tile is written

    // this CTA's columns: the cluster's KS partials summed in rank order, four at a time
    const u32 q0 = rank * QUADS / KS, quads = (rank + 1) * QUADS / KS - q0;
    for (u32 q = tid; q < MT * quads; q += THREADS) {
        const u32 c = q / quads, r = (q0 + q % quads) * 4;
        const u32 local = smem_u32(part + c * PSTRIDE + r);
        f32x4 s = load_peer(local, 0);
#pragma unroll
        for (u32 p = 1; p < KS; ++p) {
            const f32x4 v = load_peer(local, p);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
        const u32 row = row0 + r;
        if (c >= m || row >= n) continue;
        u16* dst = out + c * out_stride + row;
        if (row + 4 <= n && (out_stride & 3) == 0) {  // 8 bytes on 8 (out starts on 16)
            const u32 lo = (u32)to_dtype(s.x) | ((u32)to_dtype(s.y) << 16);
            const u32 hi = (u32)to_dtype(s.z) | ((u32)to_dtype(s.w) << 16);
            asm volatile("st.global.v2.u32 [%0], {%1, %2};"
                         :: "l"(dst), "r"(lo), "r"(hi) : "memory");
        } else {  // the last rows of w, or rows of out off 8 bytes
            dst[0] = to_dtype(s.x);
            if (row + 1 < n) dst[1] = to_dtype(s.y);
            if (row + 2 < n) dst[2] = to_dtype(s.z);
            if (row + 3 < n) dst[3] = to_dtype(s.w);
        }
    }
    cluster_sync();  // no CTA leaves while the cluster reads its shared memory
}
