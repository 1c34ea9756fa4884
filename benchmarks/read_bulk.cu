// A streaming-read kernel for the read-only ceiling (benchmarks/common.py read_bandwidth): each CTA
// reads its contiguous share of a buffer by TMA bulk copies (cp.async.bulk) into a ring of
// STAGES shared-memory stages of CHUNK bytes, one thread driving the ring, and sums one word of
// every chunk so the reads have a consumer. No thread loads the data itself: what is measured is
// how fast the copy engines stream HBM, the way xhal's native kernels read their weights.
// Compiled by xhal/platforms/cuda/native.py with -DCHUNK= -DSTAGES=.

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

extern "C" __global__ void __launch_bounds__(32, 1) read_bulk(
    const unsigned char* __restrict__ src, u64 chunks, u32* __restrict__ out)
{
    extern __shared__ unsigned char smem[];
    if (threadIdx.x != 0) return;
    const u32 ring = smem_u32(smem);
    const u32 bars = smem_u32(smem + STAGES * CHUNK);
    const u64 begin = chunks * blockIdx.x / gridDim.x, end = chunks * (blockIdx.x + 1) / gridDim.x;
    const u64 n = end - begin;
    for (int s = 0; s < STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bars + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (u64 k = 0; k < n + STAGES; ++k) {
        const u32 slot = (u32)(k % STAGES), bar = bars + 8 * slot;
        if (k >= STAGES) {  // consume chunk k - STAGES
            u32 done = 0;
            while (!done) {
                asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                             " selp.u32 %0, 1, 0, p; }"
                             : "=r"(done) : "r"(bar), "r"((u32)((k / STAGES - 1) & 1)) : "memory");
            }
            u32 v;
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(ring + slot * CHUNK));
            out[blockIdx.x] += v;
        }
        if (k < n) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                         :: "r"(bar), "r"((u32)CHUNK) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                         " [%0], [%1], %2, [%3];"
                         :: "r"(ring + slot * CHUNK), "l"(src + (begin + k) * CHUNK),
                            "r"((u32)CHUNK), "r"(bar) : "memory");
        }
    }
}
