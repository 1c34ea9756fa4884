/* Sixteen float32 lanes (one AVX-512 register; two AVX2 ones) as GCC vector extensions, and
 * the helpers the native attention kernels share: loads and stores that need no alignment, a
 * splat, a lane select and e^x of non-positive lanes. Header-only (static inline): each kernel
 * file includes it. */

#ifndef XHAL_VEC16_H
#define XHAL_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 select16(v16i keep, v16 a, v16 b) {
    return (v16)(((v16i)a & keep) | ((v16i)b & ~keep));
}

/* e^x for x <= 0: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cephes' expf polynomial);
 * 0 below -87 (and for -inf), NaN stays NaN */
static inline v16 exp_nonpositive(v16 x) {
    v16i keep = (x > splat(-87.0f)) | (x != x);
    v16 clamped = select16(keep, x, splat(-87.0f));
    const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (clamped * 1.44269504088896341f + magic) - magic;
    v16 r = clamped - n * 0.693359375f; /* ln 2 in two parts: the first product is exact */
    r = r - n * -2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return select16(keep, p * (v16)bits, splat(0.0f));
}

#endif
