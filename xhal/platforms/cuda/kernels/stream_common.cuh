// What xhal's native decode kernels share (mlp_block.cu, gemv_stream.cu): 16-bit float
// conversions, TMA bulk copies into shared-memory stages completed on mbarriers, programmatic
// dependent launch, a grid barrier, and the two steps every weight-streaming phase takes: the
// input rows (optionally the residual add + RMSNorm) held in registers, and the dot products of a
// stage of weight rows with them, reduced to one value per row and input row.
//
// The includer defines DTYPE_BF16 (else fp16), USE_PDL and THREADS, and may define TIMING. No
// headers: NVRTC compiles these files as they are.

#pragma once

#ifndef TIMING  // 1: each CTA's thread 0 stores %globaltimer at the phase boundaries (bench only)
#define TIMING 0
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
// our own 16-byte chunk type: NVRTC compiles this file with no headers at all
struct alignas(16) chunk16 { u32 x, y, z, w; };

// ---- numbers ----

__device__ __forceinline__ float lo_f32(u32 v) {
#if DTYPE_BF16
    return __uint_as_float(v << 16);
#else
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(f) : "r"(v));
    return f;
#endif
}

__device__ __forceinline__ float hi_f32(u32 v) {
#if DTYPE_BF16
    return __uint_as_float(v & 0xffff0000u);
#else
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(v));
    return f;
#endif
}

__device__ __forceinline__ u16 to_dtype(float f) {
    u16 v;
#if DTYPE_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
#endif
    return v;
}

__device__ __forceinline__ float round_dtype(float f) {
    u16 v = to_dtype(f);
    return lo_f32((u32)v);
}

// the 8 values of a 16-byte chunk as fp32
__device__ __forceinline__ void unpack8(chunk16 c, float* out) {
    out[0] = lo_f32(c.x); out[1] = hi_f32(c.x);
    out[2] = lo_f32(c.y); out[3] = hi_f32(c.y);
    out[4] = lo_f32(c.z); out[5] = hi_f32(c.z);
    out[6] = lo_f32(c.w); out[7] = hi_f32(c.w);
}

__device__ __forceinline__ float dot8(chunk16 w, const float* a) {
    float s = lo_f32(w.x) * a[0];
    s = fmaf(hi_f32(w.x), a[1], s);
    s = fmaf(lo_f32(w.y), a[2], s);
    s = fmaf(hi_f32(w.y), a[3], s);
    s = fmaf(lo_f32(w.z), a[4], s);
    s = fmaf(hi_f32(w.z), a[5], s);
    s = fmaf(lo_f32(w.w), a[6], s);
    s = fmaf(hi_f32(w.w), a[7], s);
    return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- memory ----

// a global load that skips L1: act is written by other CTAs of this launch, and every buffer here
// is reused by later launches at the same address
__device__ __forceinline__ chunk16 load_cg(const void* p) {
    chunk16 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// a 32-bit global load of data the kernel ahead wrote: asm volatile, so that the compiler keeps it
// after pdl_wait (ptxas moved plain loads of const __restrict__ data, LDG.E.CONSTANT, above
// griddepcontrol.wait in a version of moe_block.cu: the previous graph replay's routing was read)
__device__ __forceinline__ u32 load_u32_cg(const void* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ chunk16 lds128(u32 addr) {
    chunk16 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ void sts128(u32 addr, chunk16 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}

// the one arrival of a stage's use, announcing the bytes its copies will complete
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

// one TMA bulk copy global -> shared, completing `bytes` on the mbarrier
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// the threads' reads of a stage (generic proxy) before the TMA's write into it (async proxy)
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void pdl_wait() {
#if USE_PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if USE_PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Every CTA arrives once; the last to arrive resets the count and publishes the next generation,
// the others wait for it. acq_rel on the arrival and release/acquire on the generation carry every
// CTA's stores before its arrival to every CTA after the barrier.
__device__ __forceinline__ void grid_barrier(u32* sync, u32 next_gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u32 arrived;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(sync) : "memory");
        if (arrived == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.u32 [%0], 0;" :: "l"(sync) : "memory");
            asm volatile("st.release.gpu.u32 [%0], %1;" :: "l"(sync + 1), "r"(next_gen) : "memory");
        } else {
            u32 gen;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(gen) : "l"(sync + 1) : "memory");
            } while (gen != next_gen);
        }
        __threadfence();
    }
    __syncthreads();
}

// TIMING: the time of mark `i` of this CTA (thread 0) into timing[blockIdx.x * 8 + i]
__device__ __forceinline__ void mark(u64* timing, int i) {
#if TIMING
    if (threadIdx.x == 0) {
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        timing[blockIdx.x * 8 + i] = t;
    }
#endif
}

// this CTA's share [begin, end) of `units` split as evenly as the grid allows
__device__ __forceinline__ void share(u32 units, u32* begin, u32* end) {
    *begin = (u32)(((u64)units * blockIdx.x) / gridDim.x);
    *end = (u32)(((u64)units * (blockIdx.x + 1)) / gridDim.x);
}

// ---- the steps of a streaming phase ----

// This thread's 16-byte chunks of a Kdim-wide input row: chunk tid + c * THREADS for c < Cpt.
// in[c][m][e] = the input of row m at column (tid + c * THREADS) * 8 + e (0 past Kdim).
// Norm: the input is rms_norm(x + residual) * norm_w (fp32, not rounded), the sum stored in the
// dtype to residual_out (when store_residual; rows Kdim apart); else x as it is.
template <int Kdim, int Mrows, int Cpt, bool Norm>
__device__ __forceinline__ void load_input(
    float (&in)[Cpt][Mrows][8], const u16* x, const u16* residual, const u16* norm_w,
    u16* residual_out, long long x_stride, long long res_stride, float eps, bool store_residual,
    float* red /* [THREADS / 32][Mrows] */)
{
    constexpr int Chunks = Kdim / 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss[Mrows];
#pragma unroll
    for (int m = 0; m < Mrows; ++m) ss[m] = 0.f;
    float g[Cpt][8];
#pragma unroll
    for (int c = 0; c < Cpt; ++c) {
        const int chunk = tid + c * THREADS;
        if (chunk >= Chunks) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                g[c][e] = 0.f;
#pragma unroll
                for (int m = 0; m < Mrows; ++m) in[c][m][e] = 0.f;
            }
            continue;
        }
        if (Norm) unpack8(load_cg(norm_w + chunk * 8), g[c]);
#pragma unroll
        for (int m = 0; m < Mrows; ++m) {
            float a[8];
            unpack8(load_cg(x + m * x_stride + chunk * 8), a);
            if (!Norm) {
#pragma unroll
                for (int e = 0; e < 8; ++e) in[c][m][e] = a[e];
                continue;
            }
            float b[8];
            unpack8(load_cg(residual + m * res_stride + chunk * 8), b);
            u32 packed[4];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const u16 v = to_dtype(a[e] + b[e]);  // the residual stream keeps the dtype
                in[c][m][e] = lo_f32((u32)v);
                ss[m] = fmaf(in[c][m][e], in[c][m][e], ss[m]);
                if (e & 1) packed[e >> 1] |= ((u32)v) << 16; else packed[e >> 1] = v;
            }
            if (store_residual) {
                chunk16 v;
                v.x = packed[0]; v.y = packed[1]; v.z = packed[2]; v.w = packed[3];
                *(chunk16*)(residual_out + m * Kdim + chunk * 8) = v;
            }
        }
    }
    if constexpr (Norm) {  // the sums of squares: 1 / rms scales each row
#pragma unroll
        for (int m = 0; m < Mrows; ++m) {
            const float w = warp_sum(ss[m]);
            if (lane == 0) red[warp * Mrows + m] = w;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < Mrows; ++m) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < THREADS / 32; ++w) t += red[w * Mrows + m];
            const float inv = rsqrtf(t / Kdim + eps);
#pragma unroll
            for (int c = 0; c < Cpt; ++c)
#pragma unroll
                for (int e = 0; e < 8; ++e) in[c][m][e] *= g[c][e] * inv;
        }
    }
}

// The Rows weight rows of a stage (row r at stage + r * Kdim * 2) against the input: each warp's
// partial sums to parts[(warp * Rows + r) * Mrows + m]; the caller syncs, then sums over the warps.
template <int Kdim, int Mrows, int Cpt, int Rows>
__device__ __forceinline__ void stage_dots(u32 stage, const float (&in)[Cpt][Mrows][8], float* parts)
{
    constexpr int Chunks = Kdim / 8;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float acc[Rows][Mrows];
#pragma unroll
    for (int r = 0; r < Rows; ++r)
#pragma unroll
        for (int m = 0; m < Mrows; ++m) acc[r][m] = 0.f;
#pragma unroll
    for (int c = 0; c < Cpt; ++c) {
        const int chunk = tid + c * THREADS;
        if (chunk < Chunks) {
#pragma unroll
            for (int r = 0; r < Rows; ++r) {
                const chunk16 w = lds128(stage + r * Kdim * 2 + chunk * 16);
#pragma unroll
                for (int m = 0; m < Mrows; ++m) acc[r][m] += dot8(w, in[c][m]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < Rows; ++r)
#pragma unroll
        for (int m = 0; m < Mrows; ++m) {
            const float v = warp_sum(acc[r][m]);
            if (lane == 0) parts[(warp * Rows + r) * Mrows + m] = v;
        }
}

// the sum over the warps of one (row, input row) partial of stage_dots
template <int Mrows, int Rows>
__device__ __forceinline__ float stage_sum(const float* parts, int r, int m) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) s += parts[(w * Rows + r) * Mrows + m];
    return s;
}
