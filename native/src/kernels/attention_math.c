/* Vector math on f32 rows for the paged-attention kernel: converting cache
 * rows to f32, blocks of dot products, exp of shifted scores and the P.V
 * accumulation, each with an AVX2/FMA path and a scalar one. Nothing here
 * knows about pages, block tables or GGML graphs.
 *
 * This file is compiled twice on x86-64: once for the x86-64 baseline (the
 * scalar paths; table pp_attention_math_generic) and once with
 * -march=x86-64-v3 (table pp_attention_math_avx2, functions suffixed _avx2).
 * attention_math_select.c picks a table at run time, so the library loads
 * and runs on CPUs without AVX2. */
#include "kernels/attention_math.h"
#include "ggml-cpu.h"
#include "kernels/math_variant.h"

#include <math.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PP_ATTN_AVX2 1
#include <immintrin.h>
#include "kernels/vec_exp.h"
#endif

#define PP_QK8_0          32   /* q8_0 block: one f16 scale and 32 int8 */

/* One K or V row of the cache to f32. f16 and q8_0 have SIMD paths: GGML's
 * exported row converters (ggml-base) are scalar. */
static void FN(row_to_f32)(const struct ggml_tensor *cache, const void *src, float *restrict dst, int n) {
#ifdef PP_ATTN_AVX2
    if (cache->type == GGML_TYPE_F16 && n % 8 == 0) {
        const uint16_t *h = src;
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        return;
    }
    if (cache->type == GGML_TYPE_Q8_0) {
        const uint8_t *blk = src;
        for (int b = 0; b < n / PP_QK8_0; b++, blk += 2 + PP_QK8_0) {
            uint16_t d16;
            memcpy(&d16, blk, sizeof d16);
            const __m256 d = _mm256_set1_ps(ggml_fp16_to_fp32(d16));
            for (int i = 0; i < PP_QK8_0; i += 8) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + i));
                _mm256_storeu_ps(dst + b * PP_QK8_0 + i,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
        return;
    }
#endif
    ggml_get_type_traits(cache->type)->to_float(src, dst, n);
}

#ifdef PP_ATTN_AVX2
/* Four 8-float vectors: the register block of the dot and P.V loops. Two
 * blocks at once give eight independent FMA chains, enough to keep both FMA
 * ports busy despite the 4-cycle latency. */
typedef struct vec4 { __m256 v[4]; } vec4;

static inline vec4 zero4(void) {
    const __m256 z = _mm256_setzero_ps();
    return (vec4){{z, z, z, z}};
}

/* Vectors at p, p + stride, p + 2 stride, p + 3 stride (stride 8: 32 contiguous floats). */
static inline vec4 load4(const float *p, size_t stride) {
    return (vec4){{_mm256_loadu_ps(p), _mm256_loadu_ps(p + stride), _mm256_loadu_ps(p + 2 * stride),
                   _mm256_loadu_ps(p + 3 * stride)}};
}

static inline void store4(float *p, vec4 x) {
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(p + 8 * i, x.v[i]);
}

static inline vec4 scale4(vec4 x, float c) {
    const __m256 vc = _mm256_set1_ps(c);
    for (int i = 0; i < 4; i++) x.v[i] = _mm256_mul_ps(x.v[i], vc);
    return x;
}

/* acc.v[i] += x * y.v[i] */
static inline void fma4(vec4 *acc, __m256 x, vec4 y) {
    for (int i = 0; i < 4; i++) acc->v[i] = _mm256_fmadd_ps(x, y.v[i], acc->v[i]);
}

/* The four horizontal sums: two hadds leave each vector's half-sums per lane. */
static inline void hsum4(float *out, vec4 a) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a.v[0], a.v[1]), _mm256_hadd_ps(a.v[2], a.v[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

#ifdef PP_ATTN_AVX2
/* One key's dot product with the same operations as its lane of a four-key
 * block (one FMA chain over the row, then hsum4's pairing), so a score does
 * not depend on how many keys the call blocked it with. */
static inline float dot1(const float *restrict q, const float *restrict kj, int hd) {
    __m256 a = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kj + d), a);
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

/* s[j] = q . k_j for j < n (k rows are head_dim apart). Which key a row's
 * visible range starts or ends at moves the four-key blocks (a tile pairs
 * rows of different tokens), so every key's score is computed the same way
 * inside a block and out of one (docs/batch-invariance.md). */
static void FN(dot_rows)(const float *restrict q, const float *restrict k, int n, int hd, float *restrict s) {
    int j = 0;
#ifdef PP_ATTN_AVX2
    if (hd % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            vec4 a = zero4();
            for (int d = 0; d < hd; d += 8)
                fma4(&a, _mm256_loadu_ps(q + d), load4(k + (size_t)j * hd + d, (size_t)hd));
            hsum4(s + j, a);
        }
        for (; j < n; j++) s[j] = dot1(q, k + (size_t)j * hd, hd);
    }
#endif
    for (; j < n; j++) {
        const float *kj = k + (size_t)j * hd;
        float acc = 0.0f;
        for (int d = 0; d < hd; d++) acc += q[d] * kj[d];
        s[j] = acc;
    }
}

/* The same for two query rows at once: each key row is loaded once for both. */
static void FN(dot_rows2)(const float *restrict q0, const float *restrict q1, const float *restrict k,
                          int n, int hd, float *restrict s0, float *restrict s1) {
    int j = 0;
#ifdef PP_ATTN_AVX2
    if (hd % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            vec4 a = zero4(), b = zero4();
            for (int d = 0; d < hd; d += 8) {
                const vec4 kv = load4(k + (size_t)j * hd + d, (size_t)hd);
                fma4(&a, _mm256_loadu_ps(q0 + d), kv);
                fma4(&b, _mm256_loadu_ps(q1 + d), kv);
            }
            hsum4(s0 + j, a);
            hsum4(s1 + j, b);
        }
    }
#endif
    if (j < n) {
        FN(dot_rows)(q0, k + (size_t)j * hd, n - j, hd, s0 + j);
        FN(dot_rows)(q1, k + (size_t)j * hd, n - j, hd, s1 + j);
    }
}


/* out[j] = e^((x[j] - m) * scale) for j < n (x[j] <= m, scale > 0; out may be x); returns their sum. */
static float FN(exp_scaled)(const float *x, float *out, int n, float m, float scale) {
    int j = 0;
    float sum = 0.0f;
#ifdef PP_ATTN_AVX2
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m), vs = _mm256_set1_ps(scale);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = pp_exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vs));
        _mm256_storeu_ps(out + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vsum);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; j < n; j++) {
        out[j] = expf((x[j] - m) * scale);
        sum += out[j];
    }
    return sum;
}

/* p[j] = e^(p[j] - m) in place for j < n; returns their sum. */
static float FN(exp_shifted)(float *p, int n, float m) {
    return FN(exp_scaled)(p, p, n, m, 1.0f);
}

/* acc = acc * correction + sum_j p[j] v_j (v rows head_dim apart). */
static void FN(accumulate_pv)(float *restrict acc, float correction, const float *restrict p,
                      const float *restrict v, int n, int hd) {
    int d = 0;
#ifdef PP_ATTN_AVX2
    for (; d + 32 <= hd; d += 32) {
        vec4 a = scale4(load4(acc + d, 8), correction);
        for (int j = 0; j < n; j++)
            if (p[j] != 0.0f) fma4(&a, _mm256_set1_ps(p[j]), load4(v + (size_t)j * hd + d, 8));
        store4(acc + d, a);
    }
#endif
    for (; d < hd; d++) {
        float x = acc[d] * correction;
        for (int j = 0; j < n; j++) x += p[j] * v[(size_t)j * hd + d];
        acc[d] = x;
    }
}

/* pp_accumulate_pv for two rows sharing the chunk's V rows. */
static void FN(accumulate_pv2)(float *restrict acc0, float *restrict acc1, float c0, float c1,
                       const float *restrict p0, const float *restrict p1, const float *restrict v,
                       int n, int hd) {
#ifdef PP_ATTN_AVX2
    if (hd % 32 == 0) {
        for (int d = 0; d < hd; d += 32) {
            vec4 a = scale4(load4(acc0 + d, 8), c0), b = scale4(load4(acc1 + d, 8), c1);
            for (int j = 0; j < n; j++) {
                if (p0[j] == 0.0f && p1[j] == 0.0f) continue;   /* masked for both */
                const vec4 vj = load4(v + (size_t)j * hd + d, 8);
                fma4(&a, _mm256_set1_ps(p0[j]), vj);
                fma4(&b, _mm256_set1_ps(p1[j]), vj);
            }
            store4(acc0 + d, a);
            store4(acc1 + d, b);
        }
        return;
    }
#endif
    FN(accumulate_pv)(acc0, c0, p0, v, n, hd);
    FN(accumulate_pv)(acc1, c1, p1, v, n, hd);
}

const pp_attention_math PP_CONCAT(pp_attention_math, PP_ATTENTION_MATH_VARIANT) = {
    .name = PP_STR(PP_ATTENTION_MATH_VARIANT),
    .row_to_f32 = FN(row_to_f32),
    .dot_rows = FN(dot_rows),
    .dot_rows2 = FN(dot_rows2),
    .exp_shifted = FN(exp_shifted),
    .accumulate_pv = FN(accumulate_pv),
    .accumulate_pv2 = FN(accumulate_pv2),
};
