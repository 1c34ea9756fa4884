/* cpu-fast's native float32 kernels for the small per-layer work of a decode step: each is one
 * call where the torch path makes five to fifteen (every torch call costs microseconds of
 * dispatch on a small row; these rows take nanoseconds of arithmetic). Built and loaded by
 * native.py; every input is float32 and row-contiguous (native.py checks before calling).
 *
 * (No SiLU gate: torch's vectorized exp beats a scalar expf even on one row.)
 *
 * Reductions run in SIMD lanes (omp simd reduction), so sums are float32 in another order than
 * torch's: results agree with the reference to float32 rounding, not bit for bit. The decode
 * attention splits its (sequence, kv head) pairs over OpenMP threads: built with -fopenmp, the
 * library's libgomp.so.1 is the one torch loaded already (same soname), so these are torch's
 * own pool and thread count (torch.set_num_threads), not a second pool competing for the cores.
 * So do a norm's rows past a decode batch's; the rest is single-threaded. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Elements of a norm's rows from which its rows split over the threads: a decode batch's rows
 * (up to 64 of SmolLM2's 576) stay on one, a prefill's (1,300) go to every thread, one pass for
 * the sum and one for the scale where the torch path makes four over the rows */
#define PARALLEL_MIN_NORM_ELEMENTS 65536

/* RMSNorm of rows, after adding residual when it is given:
 * summed = x + residual (when residual != NULL; written to summed), normed = summed / rms * w. */
void xhal_add_rms_norm(const float *x, const float *residual, const float *weight, float eps,
                       int64_t rows, int64_t width, float *normed, float *summed) {
#pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN_NORM_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        const float *src = xr;
        if (residual != NULL) {
            const float *rr = residual + r * width;
            float *sr = summed + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) sr[i] = xr[i] + rr[i];
            src = sr;
        }
        float scale = 1.0f / sqrtf(dot(src, src, width) / (float)width + eps);
        float *nr = normed + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) nr[i] = src[i] * scale * weight[i];
    }
}

/* Rotate the first `rotary_dim` channels of one head (x: D floats) into dst by the cos / sin
 * row of its position (cos then sin, rotary_dim / 2 each); channels past rotary_dim are copied.
 * NeoX pairs i with i + R/2, GPT-J 2i with 2i + 1. */
static void rotate(const float *x, const float *cos_sin, int64_t rotary_dim, int64_t dim,
                   int neox, float *dst) {
    int64_t half = rotary_dim / 2;
    const float *cos = cos_sin, *sin = cos_sin + half;
    if (neox) {  // contiguous halves: a loop the compiler vectorizes
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[i + half];
            dst[i] = x1 * cos[i] - x2 * sin[i];
            dst[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            float x1 = x[2 * i], x2 = x[2 * i + 1];
            dst[2 * i] = x1 * cos[i] - x2 * sin[i];
            dst[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
        }
    }
    for (int64_t i = rotary_dim; i < dim; i++) dst[i] = x[i];
}

/* rotate() over `heads` heads laid out dim floats apart, by the cos / sin row of one position;
 * a plain copy when cos_sin_row is NULL (no rotary). */
static void rotate_heads(const float *x, int64_t heads, const float *cos_sin_row,
                         int64_t rotary_dim, int64_t dim, int neox, float *dst) {
    if (cos_sin_row == NULL) {
        memcpy(dst, x, sizeof(float) * (size_t)(heads * dim));
        return;
    }
    for (int64_t h = 0; h < heads; h++)
        rotate(x + h * dim, cos_sin_row, rotary_dim, dim, neox, dst + h * dim);
}

/* The cos / sin row of token b's position; NULL when there is no rotary table (positions is
 * then not read: it may be NULL too). */
static const float *position_row(const float *cos_sin, const int32_t *positions, int64_t b,
                                 int64_t rotary_dim) {
    return cos_sin == NULL ? NULL : cos_sin + (int64_t)positions[b] * rotary_dim;
}

/* Keys ahead of the one read whose row the attention asks the caches for: a kv head's keys
 * are a row apart, a stride the hardware prefetchers follow only partly */
#define AHEAD 8

static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* The sum of x's lanes, as a tree of halves. */
static inline float hsum16(v16 x) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 lo8, hi8;
    memcpy(&lo8, &x, sizeof lo8);
    memcpy(&hi8, (const char *)&x + sizeof lo8, sizeof hi8);
    lo8 += hi8;
    v4 lo4, hi4;
    memcpy(&lo4, &lo8, sizeof lo4);
    memcpy(&hi4, (const char *)&lo8 + sizeof lo4, sizeof hi4);
    lo4 += hi4;
    return (lo4[0] + lo4[2]) + (lo4[1] + lo4[3]);
}

/* One kv head's part of the attention for a head dim D known when compiled (32, 64, 128), a key
 * (or value) row in D / 16 vectors held in registers:
 *   key_scores_D: scores[g * stride + p] = scale * q_g . key_p (soft-capped when soft_cap > 0)
 *     for the group's query heads g < group (q: [group, D]) and keys p in [lo, hi);
 *   weighted_sum_D: o[0:D] = inv * sum over p in [lo, hi) of w[p] * value_p.
 * Key p's row is base + rows[p] * row; the row AHEAD keys on is asked of the caches. */
#define KV_HEAD_STEPS(D)                                                                        \
    static void key_scores_##D(const float *q, int64_t group, int64_t lo, int64_t hi,          \
                               const float *base, const int64_t *rows, int64_t row,            \
                               float scale, float soft_cap, float *scores, int64_t stride) {   \
        for (int64_t p = lo; p < hi; p++) {                                                     \
            if (p + AHEAD < hi) prefetch_row(base + rows[p + AHEAD] * row, D);                  \
            const float *key = base + rows[p] * row;                                            \
            v16 kv[D / 16];                                                                     \
            for (int i = 0; i < D / 16; i++) kv[i] = load16(key + 16 * i);                      \
            for (int64_t g = 0; g < group; g++) {                                               \
                const float *qg = q + g * D;                                                    \
                v16 acc = load16(qg) * kv[0];                                                   \
                for (int i = 1; i < D / 16; i++) acc += load16(qg + 16 * i) * kv[i];            \
                float s = hsum16(acc) * scale;                                                  \
                if (soft_cap > 0.0f) s = soft_cap * tanhf(s / soft_cap);                        \
                scores[g * stride + p] = s;                                                     \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    static void weighted_sum_##D(const float *w, int64_t lo, int64_t hi, float inv,            \
                                 const float *base, const int64_t *rows, int64_t row,          \
                                 float *o) {                                                    \
        v16 acc[D / 16];                                                                        \
        for (int i = 0; i < D / 16; i++) acc[i] = splat(0.0f);                                  \
        for (int64_t p = lo; p < hi; p++) {                                                     \
            if (p + AHEAD < hi) prefetch_row(base + rows[p + AHEAD] * row, D);                  \
            const float *value = base + rows[p] * row;                                          \
            v16 wp = splat(w[p]);                                                               \
            for (int i = 0; i < D / 16; i++) acc[i] += wp * load16(value + 16 * i);             \
        }                                                                                       \
        for (int i = 0; i < D / 16; i++) store16(o + 16 * i, acc[i] * inv);                     \
    }

KV_HEAD_STEPS(32)
KV_HEAD_STEPS(64)
KV_HEAD_STEPS(128)

/* s[0:n] = e^(s - max s), sixteen lanes at a time (vec16.h's polynomial: the scalar expf was
 * most of a long context's attention); returns their sum. */
static float softmax_weights(float *s, int64_t n) {
    v16 top16 = splat(-INFINITY), sum16 = splat(0.0f);
    int64_t whole = n - n % 16;
    for (int64_t p = 0; p < whole; p += 16) {
        v16 x = load16(s + p);
        top16 = select16(x > top16, x, top16);
    }
    float top = -INFINITY;
    for (int64_t i = 0; i < 16; i++) top = top16[i] > top ? top16[i] : top;
    for (int64_t p = whole; p < n; p++) top = s[p] > top ? s[p] : top;
    for (int64_t p = 0; p < whole; p += 16) {
        v16 e = exp_nonpositive(load16(s + p) - top);
        store16(s + p, e);
        sum16 += e;
    }
    if (whole < n) { /* the ragged tail through one padded vector: its pad lanes give e^-inf = 0 */
        float tail[16];
        for (int64_t i = 0; i < 16; i++) tail[i] = whole + i < n ? s[whole + i] : -INFINITY;
        v16 e = exp_nonpositive(load16(tail) - top);
        store16(tail, e);
        memcpy(s + whole, tail, sizeof(float) * (size_t)(n - whole));
        sum16 += e;
    }
    return hsum16(sum16);
}

/* (key, kv head) pairs of a step from which its attention runs on several threads: 8 sequences
 * of 32 keys over 3 kv heads (768) took 57 us on one thread, 37 on two; one of 64 (192), 22
 * and 19 us, not worth the region */
#define PARALLEL_MIN_KEY_HEADS 512

/* One decode step of one layer for num_seqs one-token sequences, token b being sequence b:
 *   1. rotate q_b and k_b (when cos_sin != NULL) and write k_b, v_b to flat cache row slots[b]
 *      (skipped for slot -1); k_cache / v_cache are [rows, kv_heads, dim];
 *   2. attend: query head h of token b against kv head h / (heads / kv_heads) at the key
 *      positions p of [lo_b, lens[b]) (lo_b = lens[b] - window when window > 0, else 0), read
 *      from cache rows kv_rows[b * max_len + p]; scores scaled, capped by soft_cap * tanh(s /
 *      soft_cap) when soft_cap > 0, softmax, weighted sum of values -> out [num_seqs, heads, dim].
 * q, k, v rows are q_stride / kv_stride floats apart, heads dim floats apart. Returns 0, or -1
 * when scratch memory could not be had (nothing was written then). Head dims 32, 64 and 128
 * take the register paths above (KV_HEAD_STEPS; 1,300 keys of SmolLM2's heads, one thread, a
 * Sapphire Rapids: 202 us a layer against 384 for the loop below, 512 before the prefetch);
 * any other head dim takes that loop. */
int xhal_decode_attention(const float *q, const float *k, const float *v, int64_t q_stride,
                          int64_t kv_stride, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                          int64_t dim, const int32_t *positions, const float *cos_sin,
                          int64_t rotary_dim, int neox, const int64_t *slots, float *k_cache,
                          float *v_cache, const int64_t *kv_rows, const int64_t *lens,
                          int64_t max_len, int64_t window, float scale, float soft_cap,
                          float *out) {
    int64_t group = heads / kv_heads, row = kv_heads * dim, items = num_seqs * kv_heads;
    int64_t keys = 0;
    for (int64_t b = 0; b < num_seqs; b++) keys += lens[b];
    /* threads only for steps worth a fork and join: a parallel region costs microseconds on an
     * idle machine and a scheduler time slice when other processes hold the cores */
    int threads = items > 1 && keys * kv_heads >= PARALLEL_MIN_KEY_HEADS ? omp_get_max_threads()
                                                                          : 1;
    /* scratch per thread, had before anything is written: a group's rotated queries and its
     * scores */
    size_t per_thread = (size_t)(group * dim + group * (max_len > 0 ? max_len : 1));
    /* the register paths of this head dim, or none (the loop below) */
    void (*key_scores)(const float *, int64_t, int64_t, int64_t, const float *, const int64_t *,
                       int64_t, float, float, float *, int64_t) =
        dim == 32 ? key_scores_32 : dim == 64 ? key_scores_64 : dim == 128 ? key_scores_128 : NULL;
    void (*weighted_sum)(const float *, int64_t, int64_t, float, const float *, const int64_t *,
                         int64_t, float *) =
        dim == 32    ? weighted_sum_32
        : dim == 64  ? weighted_sum_64
        : dim == 128 ? weighted_sum_128
                     : NULL;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)threads);
    if (scratch == NULL) return -1;
    for (int64_t b = 0; b < num_seqs; b++) {
        if (slots[b] < 0) continue;
        const float *kb = k + b * kv_stride, *vb = v + b * kv_stride;
        float *kc = k_cache + slots[b] * row, *vc = v_cache + slots[b] * row;
        rotate_heads(kb, kv_heads, position_row(cos_sin, positions, b, rotary_dim), rotary_dim,
                     dim, neox, kc);
        memcpy(vc, vb, sizeof(float) * (size_t)row);
    }
    /* every (sequence, kv head) pair on its own: the batch's pairs split over the threads
     * (a batch-8 step's attention is a tenth of its time on one thread) */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; item++) {
        int64_t b = item / kv_heads, kh = item % kv_heads;
        float *q_rot = scratch + per_thread * (size_t)omp_get_thread_num();
        float *scores = q_rot + group * dim;
        rotate_heads(q + b * q_stride + kh * group * dim, group,
                     position_row(cos_sin, positions, b, rotary_dim), rotary_dim, dim, neox,
                     q_rot);
        int64_t hi = lens[b], lo = window > 0 && hi > window ? hi - window : 0;
        const int64_t *rows_b = kv_rows + b * max_len;
        const float *keys_h = k_cache + kh * dim, *values_h = v_cache + kh * dim;
        if (key_scores != NULL) {
            key_scores(q_rot, group, lo, hi, keys_h, rows_b, row, scale, soft_cap, scores,
                       max_len);
            for (int64_t g = 0; g < group; g++) {
                float *sg = scores + g * max_len;
                float inv = 1.0f / softmax_weights(sg + lo, hi - lo);
                weighted_sum(sg, lo, hi, inv, values_h, rows_b, row,
                             out + (b * heads + kh * group + g) * dim);
            }
            continue;
        }
        for (int64_t p = lo; p < hi; p++) {  // every query head of the group, key by key
            if (p + AHEAD < hi) prefetch_row(keys_h + rows_b[p + AHEAD] * row, dim);
            const float *key = keys_h + rows_b[p] * row;
            for (int64_t g = 0; g < group; g++) {
                float s = dot(q_rot + g * dim, key, dim) * scale;
                if (soft_cap > 0.0f) s = soft_cap * tanhf(s / soft_cap);
                scores[g * max_len + p] = s;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *sg = scores + g * max_len;
            float *o = out + (b * heads + kh * group + g) * dim;
            float total = softmax_weights(sg + lo, hi - lo);
            memset(o, 0, sizeof(float) * (size_t)dim);
            for (int64_t p = lo; p < hi; p++) {
                if (p + AHEAD < hi) prefetch_row(values_h + rows_b[p + AHEAD] * row, dim);
                const float *value = values_h + rows_b[p] * row;
                float weight = sg[p] / total;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) o[i] += weight * value[i];
            }
        }
    }
    free(scratch);
    return 0;
}

/* Tokens x channels of a prefill's q and k rows from which their rotation splits over threads */
#define PARALLEL_MIN_ROTARY_ELEMENTS 65536

/* The rotary and KV write of a step's tokens, one pass over their rows where the torch path
 * makes five (a prefill's, too many tokens for one rotation matrix each): token t's q heads
 * [heads, dim] and k heads [kv_heads, dim] rotated by the cos / sin row of positions[t] into
 * out[t] = [heads + kv_heads, dim] (q's then k's), and the rotated k and v written to flat cache
 * row slots[t] (skipped for slot -1). Rows of q are q_stride floats apart, of k and v kv_stride;
 * tokens split over torch's threads past a decode batch's size. */
void xhal_rotary_write(const float *q, const float *k, const float *v, int64_t q_stride,
                       int64_t kv_stride, int64_t num_tokens, int64_t heads, int64_t kv_heads,
                       int64_t dim, const int32_t *positions, const float *cos_sin,
                       int64_t rotary_dim, int neox, const int64_t *slots, float *k_cache,
                       float *v_cache, float *out) {
    int64_t row = kv_heads * dim, width = (heads + kv_heads) * dim;
#pragma omp parallel for schedule(static) if (num_tokens * width >= PARALLEL_MIN_ROTARY_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cs = position_row(cos_sin, positions, t, rotary_dim);
        float *qt = out + t * width, *kt = qt + heads * dim;
        rotate_heads(q + t * q_stride, heads, cs, rotary_dim, dim, neox, qt);
        rotate_heads(k + t * kv_stride, kv_heads, cs, rotary_dim, dim, neox, kt);
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, kt, sizeof(float) * (size_t)row);
        memcpy(v_cache + slots[t] * row, v + t * kv_stride, sizeof(float) * (size_t)row);
    }
}

/* The greedy pick of each row of logits [rows, width] (width >= 1, rows `stride` floats apart),
 * as torch.argmax picks: the
 * index of the largest value, the lowest on ties, and the first NaN's when the row has one
 * (NaN counts as the largest). One vectorized pass for the maximum (and whether a NaN is there),
 * then a scan for its first index: torch's reduction keeps an index per lane and runs far
 * slower over a 49,152-wide vocabulary on this CPU. */
void xhal_argmax_rows(const float *logits, int64_t rows, int64_t width, int64_t stride,
                      int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        float best = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < width; i++) {
            best = x[i] > best ? x[i] : best;
            nan |= x[i] != x[i];
        }
        int64_t at = 0;
        if (nan)
            while (x[at] == x[at]) at++;
        else
            while (x[at] != best) at++;
        out[r] = at;
    }
}
