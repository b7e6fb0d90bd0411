/* The sampler's passes over a whole logits row (262,144 floats for Gemma 3,
 * a megabyte that does not stay in cache across a batch). scan_row reads
 * the row once, block by block: each block's maximum, then (in L1) its
 * weights e^((x - max) / T) and their sum, the weights written out only
 * when a draw needs them. The weights are most of the sampler's work, so
 * they use the cheaper pp_exp2_nonpositive. The other passes read stored
 * weights or a few blocks and find the rare entries they select from a
 * vector compare's bit mask.
 *
 * Compiled twice on x86-64 like attention_math.c: the x86-64 baseline
 * (scalar loops; table pp_sampling_math_generic) and -march=x86-64-v3
 * (pp_sampling_math_avx2). */
#include "kernels/sampling_math.h"
#include "kernels/math_variant.h"

#include <math.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#define PP_SAMPLING_AVX2 1
#include "kernels/vec_exp.h"
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

/* The sum of e^((x[j] - m) * scale) over x[0..n) (x[j] <= m, scale > 0),
 * each weight stored in w[j] when w is given. */
static float FN(block_weigh)(const float *x, int32_t n, float m, float scale, float *w) {
    float sum = 0.0f;
    int32_t j = 0;
#ifdef PP_SAMPLING_AVX2
    __m256 vsum = _mm256_setzero_ps();
    /* in powers of 2: t = x * scale * log2(e) - m * scale * log2(e) */
    const float s2 = scale * 1.44269504f;
    const __m256 vs2 = _mm256_set1_ps(s2), vms2 = _mm256_set1_ps(m * s2);
    if (w)
        for (; j + 8 <= n; j += 8) {
            const __m256 e = pp_exp2_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), vs2, vms2));
            vsum = _mm256_add_ps(vsum, e);
            _mm256_storeu_ps(w + j, e);
        }
    else
        for (; j + 8 <= n; j += 8)
            vsum = _mm256_add_ps(vsum, pp_exp2_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), vs2, vms2)));
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#endif
    for (; j < n; j++) {
        const float e = expf((x[j] - m) * scale);
        sum += e;
        if (w) w[j] = e;
    }
    return sum;
}

static void FN(scan_row)(const float *x, int32_t n, pp_row_scan *scan) {
    float m = -INFINITY;      /* the largest entry so far */
    int32_t best = 0;
    double mass = 0.0;        /* weights relative to m */
    for (int32_t start = 0, b = 0; start < n; start += PP_SUM_BLOCK, b++) {
        const int32_t len = start + PP_SUM_BLOCK < n ? PP_SUM_BLOCK : n - start;
        const float *blk = x + start;
        const float bm = FN(block_max)(blk, len);
        if (scan->block_maxes) scan->block_maxes[b] = bm;
        if (bm > m) {
            int32_t i = 0;
            while (blk[i] != bm) i++;
            best = start + i;
            /* A new best: the mass so far was weighed against the old one. */
            if (scan->scale > 0.0f && mass > 0.0) mass *= exp((double)(m - bm) * scan->scale);
            m = bm;
        }
        if (!(scan->scale > 0.0f)) continue;
        float *w = scan->weights ? scan->weights + start : NULL;
        float sum = 0.0f;   /* nothing above -inf yet: every weight is 0 */
        if (m > -INFINITY) sum = FN(block_weigh)(blk, len, m, scan->scale, w);
        else if (w) memset(w, 0, sizeof(float) * (size_t)len);
        if (scan->block_sums) {
            scan->block_sums[b] = sum;
            scan->block_refs[b] = m;
        }
        mass += sum;
    }
    /* Blocks weighed against an earlier best are brought to the final one. */
    if (scan->block_sums && scan->scale > 0.0f)
        for (int32_t start = 0, b = 0; start < n; start += PP_SUM_BLOCK, b++) {
            if (scan->block_refs[b] == m) continue;
            const float f = expf((scan->block_refs[b] - m) * scan->scale);
            scan->block_sums[b] *= f;
            if (scan->weights) {
                float *w = scan->weights + start;
                const int32_t len = start + PP_SUM_BLOCK < n ? PP_SUM_BLOCK : n - start;
                for (int32_t j = 0; j < len; j++) w[j] *= f;
            }
        }
    scan->best = best;
    scan->mass = mass;
}

/* The sum of the w[j] >= v (inclusive) or > v over w[0..n). */
static float FN(mass_above)(const float *w, int32_t n, float v, int inclusive) {
    float sum = 0.0f;
    int32_t j = 0;
#ifdef PP_SAMPLING_AVX2
    const __m256 vv = _mm256_set1_ps(v);
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    if (inclusive)
        for (; j + 16 <= n; j += 16) {
            const __m256 x0 = _mm256_loadu_ps(w + j), x1 = _mm256_loadu_ps(w + j + 8);
            a = _mm256_add_ps(a, _mm256_and_ps(_mm256_cmp_ps(x0, vv, _CMP_GE_OQ), x0));
            b = _mm256_add_ps(b, _mm256_and_ps(_mm256_cmp_ps(x1, vv, _CMP_GE_OQ), x1));
        }
    else
        for (; j + 16 <= n; j += 16) {
            const __m256 x0 = _mm256_loadu_ps(w + j), x1 = _mm256_loadu_ps(w + j + 8);
            a = _mm256_add_ps(a, _mm256_and_ps(_mm256_cmp_ps(x0, vv, _CMP_GT_OQ), x0));
            b = _mm256_add_ps(b, _mm256_and_ps(_mm256_cmp_ps(x1, vv, _CMP_GT_OQ), x1));
        }
    a = _mm256_add_ps(a, b);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#endif
    for (; j < n; j++)
        if (inclusive ? w[j] >= v : w[j] > v) sum += w[j];
    return sum;
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
    .mass_above = FN(mass_above),
};
