/* e^x on eight floats for x <= 0, shared by the attention and sampling math
 * (included only by files compiled with AVX2 + FMA). */
#ifndef PP_VEC_EXP_H
#define PP_VEC_EXP_H

#include <immintrin.h>

/* -inf gives 0. 2^n by exponent bits times a degree-6 Taylor polynomial on
 * |r| <= ln2/2 (relative error below 4e-7, about 3 ulp). */
static inline __m256 pp_exp_nonpositive(__m256 x) {
    const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);   /* this operand order lets a NaN through */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(masked, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* 2^t on eight floats for t <= 0 (t below -125, -inf or NaN give 0): the
 * sampler's weights, where every entry of a row is weighed and this is most
 * of the work. Cheaper than pp_exp_nonpositive: n = round(t) from the
 * float's own rounding (adding 1.5 * 2^23 leaves n in the low mantissa
 * bits), 2^n added to the exponent bits as an integer, and a degree-5 Taylor
 * polynomial of 2^f on |f| <= 1/2 (relative error below 4e-6, where the
 * sampler's float sums of 262,144 weights are good to about 1e-5 anyway). */
static inline __m256 pp_exp2_nonpositive(__m256 t) {
    const __m256 kept = _mm256_cmp_ps(t, _mm256_set1_ps(-125.0f), _CMP_GE_OQ);
    t = _mm256_max_ps(t, _mm256_set1_ps(-125.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 shifted = _mm256_add_ps(t, magic);
    const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(shifted, magic));
    __m256 p = _mm256_set1_ps(1.33335581e-3f);   /* ln2^k / k!, k = 5 .. 0 */
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61812911e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55041087e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40226507e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147181e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_castps_si256(shifted), 23);
    return _mm256_and_ps(kept, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent)));
}

#endif
