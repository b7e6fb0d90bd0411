/* The sampler's passes over a whole logits row (262,144 floats for Gemma 3,
 * a megabyte that does not stay in cache across a batch): each pass reads
 * the row once and writes nothing per entry, so a row costs a few reads of
 * memory. The rare entries a pass selects (candidates for top-k, top-p and
 * min-p) are found from a vector compare's bit mask.
 *
 * Compiled twice on x86-64 like attention_math.c: the x86-64 baseline
 * (scalar loops; table pp_sampling_math_generic) and -march=x86-64-v3
 * (pp_sampling_math_avx2). */
#include "sampling_math.h"

#ifndef PP_ATTENTION_MATH_VARIANT
#define PP_ATTENTION_MATH_VARIANT generic
#endif
#define PP_CONCAT_(a, b) a##_##b
#define PP_CONCAT(a, b) PP_CONCAT_(a, b)
#define PP_STR_(a) #a
#define PP_STR(a) PP_STR_(a)
#define FN(name) PP_CONCAT(name, PP_ATTENTION_MATH_VARIANT)

#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#define PP_SAMPLING_AVX2 1
#include "vec_exp.h"
#endif

/* The largest of x[0..n) (NaN ignored; -inf when there is none). */
static float FN(block_max)(const float *x, int32_t n) {
    float m = -INFINITY;
    int32_t j = 0;
#ifdef PP_SAMPLING_AVX2
    if (n >= 8) {
        __m256 a = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= n; j += 8) a = _mm256_max_ps(_mm256_loadu_ps(x + j), a);   /* NaN in x yields a */
        float lanes[8];
        _mm256_storeu_ps(lanes, a);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    }
#endif
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* The sum of e^((x[j] - m) * scale) over x[0..n) (x[j] <= m); selected
 * indices (x[j] >= cut, offset by base) appended to ids at *count. */
static float FN(block_weigh_select)(const float *x, int32_t n, float m, float scale, float cut, int32_t base,
                                    int32_t *ids, int32_t *count) {
    float sum = 0.0f;
    int32_t j = 0, c = *count;
#ifdef PP_SAMPLING_AVX2
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m), vs = _mm256_set1_ps(scale), vcut = _mm256_set1_ps(cut);
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        if (scale > 0.0f)
            vsum = _mm256_add_ps(vsum, pp_exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(v, vm), vs)));
        if (ids) {
            unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, vcut, _CMP_GE_OQ));
            while (bits) {
                ids[c++] = base + j + __builtin_ctz(bits);
                bits &= bits - 1;
            }
        }
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#endif
    for (; j < n; j++) {
        if (scale > 0.0f) sum += expf((x[j] - m) * scale);
        if (ids && x[j] >= cut) ids[c++] = base + j;
    }
    *count = c;
    return sum;
}

static void FN(scan_row)(const float *x, int32_t n, pp_row_scan *scan) {
    float m = -INFINITY;      /* the largest entry so far */
    int32_t best = 0, count = 0;
    double mass = 0.0;        /* weights relative to m */
    for (int32_t start = 0, b = 0; start < n; start += PP_SUM_BLOCK, b++) {
        const int32_t len = start + PP_SUM_BLOCK < n ? PP_SUM_BLOCK : n - start;
        const float *blk = x + start;
        const float bm = FN(block_max)(blk, len);
        if (bm > m) {
            int32_t i = 0;
            while (blk[i] != bm) i++;
            best = start + i;
            /* A new best: the mass so far was weighed against the old one. */
            if (scan->scale > 0.0f && mass > 0.0) mass *= exp((double)(m - bm) * scan->scale);
            m = bm;
        }
        const float cut = m > -INFINITY ? m - scan->margin : INFINITY;
        /* nothing above -inf yet: every weight is 0 */
        const float scale = m > -INFINITY ? scan->scale : 0.0f;
        const float sum = FN(block_weigh_select)(blk, len, m, scale, cut, start, scan->ids, &count);
        if (scan->block_sums) {
            scan->block_sums[b] = sum;
            scan->block_refs[b] = m;
        }
        mass += sum;
    }
    if (scan->block_sums && scan->scale > 0.0f)
        for (int32_t start = 0, b = 0; start < n; start += PP_SUM_BLOCK, b++)
            if (scan->block_refs[b] != m) scan->block_sums[b] *= expf((scan->block_refs[b] - m) * scan->scale);
    scan->best = best;
    scan->mass = mass;
    scan->n_ids = count;
}

static void FN(weigh_row)(const float *x, int32_t n, float m, float scale, float *w) {
    int32_t j = 0;
#ifdef PP_SAMPLING_AVX2
    const __m256 vm = _mm256_set1_ps(m), vs = _mm256_set1_ps(scale);
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(w + j, pp_exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vs)));
#endif
    for (; j < n; j++) w[j] = expf((x[j] - m) * scale);
}

static int32_t FN(select_at_least)(const float *x, int32_t n, float cut, int32_t *ids) {
    int32_t count = 0, j = 0;
#ifdef PP_SAMPLING_AVX2
    const __m256 vcut = _mm256_set1_ps(cut);
    for (; j + 32 <= n; j += 32) {
        /* four vectors per test: most of a row is below the cut */
        const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(x + j), vcut, _CMP_GE_OQ);
        const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 8), vcut, _CMP_GE_OQ);
        const __m256 c = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 16), vcut, _CMP_GE_OQ);
        const __m256 d = _mm256_cmp_ps(_mm256_loadu_ps(x + j + 24), vcut, _CMP_GE_OQ);
        uint32_t bits = (uint32_t)_mm256_movemask_ps(a) | (uint32_t)_mm256_movemask_ps(b) << 8 |
                        (uint32_t)_mm256_movemask_ps(c) << 16 | (uint32_t)_mm256_movemask_ps(d) << 24;
        while (bits) {
            ids[count++] = j + __builtin_ctz(bits);
            bits &= bits - 1;
        }
    }
#endif
    for (; j < n; j++)
        if (x[j] >= cut) ids[count++] = j;
    return count;
}

const pp_sampling_math PP_CONCAT(pp_sampling_math, PP_ATTENTION_MATH_VARIANT) = {
    .name = PP_STR(PP_ATTENTION_MATH_VARIANT),
    .scan_row = FN(scan_row),
    .select_at_least = FN(select_at_least),
    .weigh_row = FN(weigh_row),
};
