/* out = x @ W.T (+ bias) for two rows of x or more (a decode batch, a prefill's rows), over a copy
 * of W packed for it.
 *
 * Why: at 2-32 rows both MKL's GEMM and oneDNN's are compute-bound on this CPU (SmolLM2's LM head
 * at 8 rows: oneDNN 7.3 ms on 2 threads, where one row's GEMV streams the same 113 MB in 3.1),
 * although 8 rows only need 16 flops per weight read: a register tile of 8 rows x 32 columns
 * does 16 FMAs per 128 bytes of weights (85 GF/s on one core from L2 here, 21 GB/s of weights,
 * about what one core streams from memory). At a prefill's rows the same tiles reach ~90 GF/s per
 * core where MKL's float32 GEMM reaches 60-80 here (AMD EPYC, Zen 4; packed.py has the figures).
 *
 * Packed layout (packed.py makes it): W [N, K] as ceil(N / 32) tiles of 32 output columns, each
 * tile [K, 32] contiguous (tile t, row k holds W[32 t .. 32 t + 31, k], zeros past N), so a tile
 * streams from memory front to back. Tiles are split over torch's OpenMP threads (libgomp, the
 * pool torch loaded; see decode_kernels.c); rows go 8 at a time through each tile while it is in
 * the core's cache. Each output is summed over k in order, one fused multiply-add per product:
 * float32 rounding in another order than MKL's (results agree to rounding, not bit for bit).
 *
 * Written with GCC's vector extension (16 floats, one AVX-512 register where the CPU has it,
 * two or four narrower ones elsewhere), no intrinsics. */

/* this file only: one rounding per product-sum (ISO C mode leaves a * b + c unfused) */
#pragma GCC optimize("fp-contract=fast")

#include <omp.h>
#include <stdint.h>
#include <string.h>

#define TILE 32 /* output columns per tile: two 16-float vectors */
#define GROUP 8 /* rows per register tile: 16 accumulators */
/* rows of a tile (128 bytes each) requested ahead of their use: the hardware prefetcher alone
 * left the LM head at 8 rows 12.4 ms on one thread, 9.7 with 32 ahead (8: 14.2, 64: 11.7) */
#define PREFETCH 32

typedef float v16 __attribute__((vector_size(64)));

/* One tile (32 columns) of `num_rows` <= GROUP rows: out[r, 0:cols] = x[r] . tile (+ bias). */
static void tile_rows(const float *x, int64_t x_stride, int64_t num_rows, int64_t depth,
                      const float *tile, const float *bias, int64_t cols, float *out,
                      int64_t out_stride) {
    const float *row[GROUP];
    /* rows past num_rows repeat the last one: computed, never stored (the loop stays fixed) */
    for (int64_t r = 0; r < GROUP; r++) row[r] = x + (r < num_rows ? r : num_rows - 1) * x_stride;
    v16 lo[GROUP], hi[GROUP];
    for (int64_t r = 0; r < GROUP; r++) lo[r] = hi[r] = (v16){0};
    for (int64_t k = 0; k < depth; k++) {
        v16 w_lo, w_hi;
        memcpy(&w_lo, tile + k * TILE, sizeof w_lo);
        memcpy(&w_hi, tile + k * TILE + 16, sizeof w_hi);
        __builtin_prefetch(tile + (k + PREFETCH) * TILE);
        __builtin_prefetch(tile + (k + PREFETCH) * TILE + 16);
        for (int64_t r = 0; r < GROUP; r++) {
            float xr = row[r][k];
            lo[r] += xr * w_lo;
            hi[r] += xr * w_hi;
        }
    }
    float sums[TILE];
    for (int64_t r = 0; r < num_rows; r++) {
        memcpy(sums, &lo[r], sizeof lo[r]);
        memcpy(sums + 16, &hi[r], sizeof hi[r]);
        if (bias != NULL)
            for (int64_t j = 0; j < cols; j++) sums[j] += bias[j];
        memcpy(out + r * out_stride, sums, sizeof(float) * (size_t)cols);
    }
}

/* x [rows, depth] (rows x_stride floats apart) times packed W [width, depth] -> out [rows, width]
 * (rows out_stride floats apart); bias [width] or NULL. */
void xhal_small_gemm(const float *x, int64_t rows, int64_t depth, int64_t x_stride,
                     const float *packed, int64_t width, const float *bias, float *out,
                     int64_t out_stride) {
    int64_t tiles = (width + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) if (tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t col = t * TILE, cols = width - col < TILE ? width - col : TILE;
        const float *tile = packed + t * depth * TILE;
        for (int64_t r = 0; r < rows; r += GROUP)
            tile_rows(x + r * x_stride, x_stride, rows - r < GROUP ? rows - r : GROUP, depth,
                      tile, bias == NULL ? NULL : bias + col, cols, out + r * out_stride + col,
                      out_stride);
    }
}
