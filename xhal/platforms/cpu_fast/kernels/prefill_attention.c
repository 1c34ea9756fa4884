/* Causal attention of a prefill chunk, float32, flash-style: scores are made a block of keys at
 * a time and folded into a running softmax, never written out whole. The chunk's Lq queries are
 * the last of its L keys (a cached prefix of L - Lq keys, or none), query i seeing keys
 * 0 .. L - Lq + i.
 *
 * Why: torch's CPU flash SDPA does one head at a time through small MKL GEMMs of depth 64; at
 * SmolLM2's 1,300-token prefill it was about a quarter of the prefill (586 ms of 2.25 s on two
 * threads). Here the query heads that share a KV head go through each key block together (the
 * block is packed once per call for all of them), with the register tiles of small_gemm.c.
 *
 * Work item: one KV head g and BQ query positions; its rows are the group's heads at those
 * positions (row r = head-in-group * nq + i). For every key block up to the item's last
 * position: S = scale * Q K^T (8 rows x 32 keys register tiles over the packed keys), the
 * running max m and sum l of each row updated, P = exp(S - m), O = O * alpha + P V. Items are
 * taken by torch's OpenMP threads (libgomp, see decode_kernels.c), longest first.
 *
 * Sums run in another order than torch's (and e^x is our polynomial, within 2 ulp): results
 * agree with SDPA's to float32 rounding, not bit for bit. */

/* this file only: one rounding per product-sum (ISO C mode leaves a * b + c unfused) */
#pragma GCC optimize("fp-contract=fast")

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define BQ 32   /* query positions per work item */
#define BK 64   /* keys per block: two key tiles */
#define KT 32   /* keys per packed tile: two 16-float vectors */
#define GROUP 8 /* rows per register tile */

/* S rows [nrows <= GROUP] x one packed key tile: s[r, 0:32] = scale * q_r . tile. */
static void score_tile(const float *const *q_rows, int64_t nrows, int64_t dim,
                       const float *tile, float scale, float *s, int64_t s_stride) {
    const float *row[GROUP];
    /* rows past nrows repeat the last one: computed, never stored (the loop stays fixed) */
    for (int64_t r = 0; r < GROUP; r++) row[r] = q_rows[r < nrows ? r : nrows - 1];
    v16 lo[GROUP], hi[GROUP];
    for (int64_t r = 0; r < GROUP; r++) lo[r] = hi[r] = (v16){0};
    for (int64_t d = 0; d < dim; d++) {
        v16 k_lo = load16(tile + d * KT), k_hi = load16(tile + d * KT + 16);
        for (int64_t r = 0; r < GROUP; r++) {
            float x = row[r][d];
            lo[r] += x * k_lo;
            hi[r] += x * k_hi;
        }
    }
    for (int64_t r = 0; r < nrows; r++) {
        store16(s + r * s_stride, lo[r] * scale);
        store16(s + r * s_stride + 16, hi[r] * scale);
    }
}

/* o[r, 0:32] += sum_j p[r, j] * v[j, 0:32] for nrows <= GROUP rows and nkeys keys. */
static void value_tile(const float *p, int64_t p_stride, int64_t nrows, int64_t nkeys,
                       const float *v, int64_t v_stride, float *o, int64_t o_stride) {
    const float *prow[GROUP];
    for (int64_t r = 0; r < GROUP; r++) prow[r] = p + (r < nrows ? r : nrows - 1) * p_stride;
    v16 lo[GROUP], hi[GROUP];
    for (int64_t r = 0; r < GROUP; r++) {
        const float *orow = o + (r < nrows ? r : nrows - 1) * o_stride;
        lo[r] = load16(orow);
        hi[r] = load16(orow + 16);
    }
    for (int64_t j = 0; j < nkeys; j++) {
        v16 v_lo = load16(v + j * v_stride), v_hi = load16(v + j * v_stride + 16);
        for (int64_t r = 0; r < GROUP; r++) {
            float w = prow[r][j];
            lo[r] += w * v_lo;
            hi[r] += w * v_hi;
        }
    }
    for (int64_t r = 0; r < nrows; r++) {
        store16(o + r * o_stride, lo[r]);
        store16(o + r * o_stride + 16, hi[r]);
    }
}

/* Keys of every KV head packed in tiles of KT: packed[g][t][d][j] = k[KT t + j, g, d], zeros past
 * the last key. */
static void pack_keys(const float *k, int64_t k_stride, int64_t num_tokens, int64_t kv_heads,
                      int64_t dim, float *packed) {
    int64_t tiles = (num_tokens + KT - 1) / KT;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < kv_heads * tiles; item++) {
        int64_t g = item / tiles, t = item % tiles;
        float *dst = packed + (g * tiles + t) * dim * KT;
        for (int64_t j = 0; j < KT; j++) {
            int64_t key = t * KT + j;
            const float *src = k + key * k_stride + g * dim;
            for (int64_t d = 0; d < dim; d++) dst[d * KT + j] = key < num_tokens ? src[d] : 0.0f;
        }
    }
}

/* One work item: KV head g, queries p0 .. p0 + nq - 1 at key positions offset + p0 .. (buffers:
 * the calling thread's). */
static void attend_item(const float *q, int64_t q_stride, const float *v, int64_t v_stride,
                        int64_t heads, int64_t kv_heads, int64_t dim, int64_t tiles,
                        const float *packed, float scale, int64_t g, int64_t offset, int64_t p0,
                        int64_t nq,
                        float *out, const float **q_rows, int64_t *pos, float *s, float *o,
                        float *m, float *l) {
    int64_t group = heads / kv_heads, rows = group * nq;
    for (int64_t r = 0; r < rows; r++) {
        int64_t head = g * group + r / nq, i = r % nq;
        q_rows[r] = q + (p0 + i) * q_stride + head * dim;
        pos[r] = offset + p0 + i;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)(rows * dim));
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t end = offset + p0 + nq; /* keys the item's last query sees */
    for (int64_t n0 = 0; n0 < end; n0 += BK) {
        int64_t nk = end - n0 < BK ? end - n0 : BK;
        int64_t block_tiles = (nk + KT - 1) / KT;
        for (int64_t r = 0; r < rows; r += GROUP)
            for (int64_t t = 0; t < block_tiles; t++)
                score_tile(q_rows + r, rows - r < GROUP ? rows - r : GROUP, dim,
                           packed + (g * tiles + n0 / KT + t) * dim * KT, scale, s + r * BK + t * KT,
                           BK);
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * BK;
            int64_t visible = pos[r] - n0 + 1 < nk ? pos[r] - n0 + 1 : nk; /* causal */
            if (visible <= 0) { /* every key of the block is in this row's future */
                memset(sr, 0, sizeof(float) * BK);
                continue;
            }
            v16 top = splat(-INFINITY);
            for (int64_t c = 0; c < BK; c += 16) {
                v16i seen = (lane + (float)c) < splat((float)visible);
                v16 x = select16(seen, load16(sr + c), splat(-INFINITY));
                top = select16(x > top, x, top);
            }
            float block_max = top[0];
            for (int j = 1; j < 16; j++) block_max = top[j] > block_max ? top[j] : block_max;
            float m_new = m[r] > block_max ? m[r] : block_max;
            float alpha = expf(m[r] - m_new); /* 0 on the first block (m = -inf) */
            v16 sum = (v16){0};
            for (int64_t c = 0; c < BK; c += 16) {
                v16i seen = (lane + (float)c) < splat((float)visible);
                v16 x = select16(seen, load16(sr + c) - m_new, splat(-INFINITY));
                v16 e = exp_nonpositive(x);
                store16(sr + c, e);
                sum += e;
            }
            float block_sum = 0.0f;
            for (int j = 0; j < 16; j++) block_sum += sum[j];
            l[r] = l[r] * alpha + block_sum;
            m[r] = m_new;
            float *orow = o + r * dim;
            for (int64_t d = 0; d < dim; d += 16) store16(orow + d, load16(orow + d) * alpha);
        }
        for (int64_t r = 0; r < rows; r += GROUP) {
            int64_t n = rows - r < GROUP ? rows - r : GROUP;
            int64_t keys = 0; /* the group's longest visible run: P is 0 past it */
            for (int64_t rr = r; rr < r + n; rr++) {
                int64_t visible = pos[rr] - n0 + 1 < nk ? pos[rr] - n0 + 1 : nk;
                keys = visible > keys ? visible : keys;
            }
            for (int64_t d = 0; d < dim; d += 32)
                value_tile(s + r * BK, BK, n, keys, v + n0 * v_stride + g * dim + d, v_stride,
                           o + r * dim + d, dim);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t head = g * group + r / nq, i = r % nq;
        float *dst = out + ((p0 + i) * heads + head) * dim;
        v16 inv = splat(1.0f / l[r]);
        for (int64_t d = 0; d < dim; d += 16) store16(dst + d, load16(o + r * dim + d) * inv);
    }
}

/* q [Lq, H, D] (rows q_stride floats apart, heads D apart), k and v [L, Hkv, D] (rows k_stride
 * / v_stride apart, L >= Lq) -> out [Lq, H, D] contiguous: causal attention, query i seeing keys
 * 0 .. L - Lq + i. D a multiple of 32, H a multiple of Hkv. Returns 0, or -1 if a buffer could
 * not be had (nothing written then). */
int xhal_prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                           const float *v, int64_t v_stride, int64_t num_queries,
                           int64_t num_keys, int64_t heads, int64_t kv_heads, int64_t dim,
                           float scale, float *out) {
    int64_t tiles = (num_keys + KT - 1) / KT;
    int64_t blocks = (num_queries + BQ - 1) / BQ;
    int64_t offset = num_keys - num_queries;
    int64_t rows = heads / kv_heads * BQ;
    float *packed = malloc(sizeof(float) * (size_t)(kv_heads * tiles * dim * KT));
    if (packed == NULL) return -1;
    int failed = 0;
#pragma omp parallel
    {
        pack_keys(k, k_stride, num_keys, kv_heads, dim, packed); /* ends in a barrier */
        const float **q_rows = malloc(sizeof(*q_rows) * (size_t)rows);
        int64_t *pos = malloc(sizeof(*pos) * (size_t)rows);
        float *s = malloc(sizeof(float) * (size_t)(rows * BK + rows * dim + 2 * rows));
        if (q_rows == NULL || pos == NULL || s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *o = s + rows * BK, *m = o + rows * dim, *l = m + rows;
            /* the last positions first: they see the most keys */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < kv_heads * blocks; item++) {
                int64_t block = blocks - 1 - item / kv_heads, g = item % kv_heads;
                int64_t p0 = block * BQ, nq = num_queries - p0 < BQ ? num_queries - p0 : BQ;
                attend_item(q, q_stride, v, v_stride, heads, kv_heads, dim, tiles, packed, scale,
                            g, offset, p0, nq, out, q_rows, pos, s, o, m, l);
            }
        }
        free(q_rows);
        free(pos);
        free(s);
    }
    free(packed);
    return failed ? -1 : 0;
}
