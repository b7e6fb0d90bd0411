/* Float panels (panel_formats.h): F16 and BF16 weights in 8-row panels, times
 * f32 activations with f32 FMAs.
 *
 * The GGML CPU build we link (libggml-python's) has no llamafile GEMM: an
 * F16 or BF16 product rounds the activations to the weight's type and runs
 * one row-by-column dot product at a time, so a 5-row verify step or a
 * prefill costs nearly a single-token step per row. Here one widened weight
 * vector serves a tile of columns, so a step with more rows costs little
 * more than reading the weights, and the activations are not rounded.
 *
 * Stored layout: panel p holds rows 8p..8p+7; per quad q of 4 values, 64
 * bytes: [8 rows][4 values] of the weight's 16-bit values (value 4q + e of
 * row r at half-word 4r + e). One AVX-512 vector widens rows 0-3 (or 4-7)
 * of a quad, one AVX2 vector two rows, and a column's 4 values are one
 * 128-bit broadcast. The same bytes as GGML's rows, moved. */
#include "panels/panel_formats.h"

#include <stdlib.h>
#include <string.h>

#define QUAD_BYTES (PP_PANEL_ROWS * 4 * 2)   /* 64 */

static inline float half_to_f32(enum ggml_type type, uint16_t h) {
    if (type == GGML_TYPE_BF16) {
        const uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    ggml_fp16_t v;
    memcpy(&v, &h, sizeof v);
    return ggml_fp16_to_fp32(v);
}

static inline const uint8_t *fpanel(const pp_q8_panels *w, int64_t pi) {
    return w->data + (size_t)pi * (size_t)(w->k / 4) * QUAD_BYTES;
}

void pp_fpanel_pack(const void *data, int64_t k, int64_t p0, int64_t p1, uint8_t *out) {
    const uint16_t *src = data;
    uint16_t *dst = (uint16_t *)out;
    for (int64_t pi = p0; pi < p1; pi++)
        for (int64_t q = 0; q < k / 4; q++)
            for (int r = 0; r < PP_PANEL_ROWS; r++)
                memcpy(dst + ((pi * (k / 4) + q) * PP_PANEL_ROWS + r) * 4,
                       src + (pi * PP_PANEL_ROWS + r) * k + 4 * q, 4 * sizeof *src);
}

void pp_fpanel_row(const pp_q8_panels *w, int64_t row, float *out) {
    const uint8_t *panel = fpanel(w, row / PP_PANEL_ROWS);
    const int r = (int)(row % PP_PANEL_ROWS);
    for (int64_t q = 0; q < w->k / 4; q++)
        for (int e = 0; e < 4; e++) {
            uint16_t h;
            memcpy(&h, panel + q * QUAD_BYTES + (4 * r + e) * 2, 2);
            out[4 * q + e] = half_to_f32(w->type, h);
        }
}

void pp_fpanel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                           size_t col_stride, int64_t n, float *out, size_t ldo) {
    for (int64_t pi = p0; pi < p1; pi++) {
        const uint8_t *panel = fpanel(w, pi);
        for (int64_t c = 0; c < n; c++) {
            const float *x = (const float *)(cols + (size_t)c * col_stride);
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t q = 0; q < w->k / 4; q++)
                    for (int e = 0; e < 4; e++) {
                        uint16_t h;
                        memcpy(&h, panel + q * QUAD_BYTES + (4 * r + e) * 2, 2);
                        acc += half_to_f32(w->type, h) * x[4 * q + e];
                    }
                out[(size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS + r] = acc;
            }
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* Panels a column tile runs over before the next tile: their bytes (4 x k x
 * 16) and a tile's columns stay in L2 while the other is reused. */
#define PANEL_GROUP 4

/* The operands of one panel's tile of columns (tile512, tile256): the panel
 * and its nq quads, the f32 columns stride bytes apart, and the output of
 * the tile's first column (8 rows; each next column ldo floats on). */
typedef struct fpanel_tile {
    const uint8_t *panel;
    int64_t        nq;
    const uint8_t *cols;
    size_t         stride;
    float         *out;
    size_t         ldo;
} fpanel_tile;

#define T512 "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define T256 "avx2,fma,f16c"

static inline __attribute__((target(T512), always_inline)) __m512 widen512(const uint8_t *p, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

/* One panel by NC columns. lo[i] holds rows 0-3 x the quad's 4 values,
 * hi[i] rows 4-7. Every width adds a column's quads in the same order (one
 * chain per half), so a column's result does not depend on how many others
 * share its step (docs/batch-invariance.md); split chains for narrow tiles
 * would hide the FMA latency, but a decode step waits on memory anyway. */
static inline __attribute__((target(T512), always_inline)) void tile512(const fpanel_tile *t, const int nc,
                                                                        const int bf16) {
    __m512 lo[12], hi[12];
    for (int i = 0; i < nc; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < t->nq; q++) {
        const uint8_t *wq = t->panel + q * QUAD_BYTES;
        const __m512 w0 = widen512(wq, bf16), w1 = widen512(wq + 32, bf16);
        for (int i = 0; i < nc; i++) {
            const __m512 xb = _mm512_broadcast_f32x4(_mm_loadu_ps((const float *)(t->cols + i * t->stride) + 4 * q));
            lo[i] = _mm512_fmadd_ps(w0, xb, lo[i]);
            hi[i] = _mm512_fmadd_ps(w1, xb, hi[i]);
        }
    }
    /* Per 128-bit lane j: pair sums of lo (row j) and hi (row j + 4), then
     * the two pairs; element 0 is row j, element 2 row j + 4. */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int i = 0; i < nc; i++) {
        const __m512 a = lo[i], b = hi[i];
        const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        const __m512 s2 = _mm512_add_ps(s1, _mm512_permute_ps(s1, _MM_SHUFFLE(2, 3, 0, 1)));
        _mm256_storeu_ps(t->out + (size_t)i * t->ldo, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s2)));
    }
}

/* BF16 weights where the CPU has AVX-512 BF16: one dot-product instruction
 * multiplies a whole quad of 8 rows (lane 2r + j: row r's values 2j, 2j +
 * 1) by the column's 4 values rounded to BF16 (one 64-bit broadcast), 32
 * multiply-adds where an FMA does 16. The activations are rounded as GGML
 * rounds them for BF16 products; each column tile is rounded once per group
 * of panels, into this thread's scratch. */
#define T512BF T512 ",avx512bf16"
#define BF16_TILE 12
static _Thread_local _Alignas(64) uint16_t bf16_columns[BF16_TILE * PP_PANEL_K_MAX_K];

static inline __attribute__((target(T512BF), always_inline)) void round_columns(const uint8_t *cols, size_t stride,
                                                                               int64_t nc, int64_t k,
                                                                               uint16_t *out) {
    for (int64_t i = 0; i < nc; i++) {
        const float *x = (const float *)(cols + (size_t)i * stride);
        for (int64_t j = 0; j < k; j += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(x + j));
            _mm512_storeu_si512(out + i * k + j, (__m512i)v);
        }
    }
}

/* One chain per column at every width, as tile512 (a column's result is the same whatever
 * the tile's width). */
static inline __attribute__((target(T512BF), always_inline)) void tile_bf16(const uint8_t *panel, int64_t nq,
                                                                           const uint16_t *xb, int64_t k,
                                                                           const int nc, float *out, size_t ldo) {
    __m512 acc[BF16_TILE];
    for (int i = 0; i < nc; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < nq; q++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + q * QUAD_BYTES);
        for (int i = 0; i < nc; i++) {
            long long four;
            memcpy(&four, xb + i * k + 4 * q, sizeof four);
            acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi64(four));
        }
    }
    /* lanes 2r and 2r + 1 are row r's two halves */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int i = 0; i < nc; i++) {
        const __m512 a = acc[i];
        const __m512 pairs = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
        _mm256_storeu_ps(out + (size_t)i * ldo, _mm512_castps512_ps256(_mm512_permutexvar_ps(even, pairs)));
    }
}

__attribute__((target(T512BF))) static void bf16_gemm_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1,
                                                      const uint8_t *cols, size_t stride, int64_t n, float *out,
                                                      size_t ldo) {
    const int64_t nq = w->k / 4, k = w->k;
    for (int64_t c = 0; c < n; c += BF16_TILE) {
        const int64_t tile = n - c < BF16_TILE ? n - c : BF16_TILE;
        round_columns(cols + (size_t)c * stride, stride, tile, k, bf16_columns);
        for (int64_t pi = p0; pi < p1; pi++) {
            const uint8_t *panel = fpanel(w, pi);
            float *o = out + (size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS;
            for (int64_t t = 0; t < tile;) {
                const int64_t left = tile - t;
                const uint16_t *xb = bf16_columns + t * k;
                float *ot = o + (size_t)t * ldo;
                if (left >= 12) { tile_bf16(panel, nq, xb, k, 12, ot, ldo); t += 12; }
                else if (left >= 8) { tile_bf16(panel, nq, xb, k, 8, ot, ldo); t += 8; }
                else if (left >= 4) { tile_bf16(panel, nq, xb, k, 4, ot, ldo); t += 4; }
                else if (left >= 2) { tile_bf16(panel, nq, xb, k, 2, ot, ldo); t += 2; }
                else { tile_bf16(panel, nq, xb, k, 1, ot, ldo); t += 1; }
            }
        }
    }
}

static inline __attribute__((target(T256), always_inline)) __m256 widen256(const uint8_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* One panel by NC columns: acc[g][i] holds rows 2g, 2g + 1 x the quad's 4 values. */
static inline __attribute__((target(T256), always_inline)) void tile256(const fpanel_tile *t, const int nc,
                                                                        const int bf16) {
    __m256 acc[4][3];
    for (int g = 0; g < 4; g++)
        for (int i = 0; i < nc; i++) acc[g][i] = _mm256_setzero_ps();
    for (int64_t q = 0; q < t->nq; q++) {
        __m256 xb[3];
        for (int i = 0; i < nc; i++)
            xb[i] = _mm256_broadcast_ps((const __m128 *)((const float *)(t->cols + i * t->stride) + 4 * q));
        for (int g = 0; g < 4; g++) {
            const __m256 wg = widen256(t->panel + q * QUAD_BYTES + 16 * g, bf16);
            for (int i = 0; i < nc; i++) acc[g][i] = _mm256_fmadd_ps(wg, xb[i], acc[g][i]);
        }
    }
    /* hadd twice: rows 0 2 4 6 in the low half, 1 3 5 7 in the high one */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < nc; i++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][i], acc[1][i]), _mm256_hadd_ps(acc[2][i], acc[3][i]));
        _mm256_storeu_ps(t->out + (size_t)i * t->ldo, _mm256_permutevar8x32_ps(h, order));
    }
}

/* Column tiles over groups of panels; the tile widths are constants so each
 * call unrolls into registers. */
#define PP_FPANEL_GEMM(NAME, TARGET, TILE_CALLS)                                                              \
    PP_PANEL_GEMM_KERNEL(NAME, TARGET) {                                                                    \
        const int64_t nq = w->k / 4;                                                                          \
        const int bf16 = w->type == GGML_TYPE_BF16;                                                           \
        for (int64_t g0 = p0; g0 < p1; g0 += PANEL_GROUP) {                                                   \
            const int64_t g1 = g0 + PANEL_GROUP < p1 ? g0 + PANEL_GROUP : p1;                                 \
            for (int64_t c = 0; c < n;) {                                                                     \
                const int64_t left = n - c;                                                                   \
                int64_t nc = 0;                                                                               \
                for (int64_t pi = g0; pi < g1; pi++) {                                                        \
                    const fpanel_tile t = {fpanel(w, pi), nq, cols + (size_t)c * col_stride, col_stride,      \
                                           out + (size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS, ldo};          \
                    TILE_CALLS                                                                                \
                }                                                                                             \
                c += nc;                                                                                      \
            }                                                                                                 \
        }                                                                                                     \
    }

PP_FPANEL_GEMM(pp_fpanel_gemm_avx512vnni, T512,
               if (left >= 12) { tile512(&t, 12, bf16); nc = 12; }
               else if (left >= 8) { tile512(&t, 8, bf16); nc = 8; }
               else if (left >= 4) { tile512(&t, 4, bf16); nc = 4; }
               else if (left >= 2) { tile512(&t, 2, bf16); nc = 2; }
               else { tile512(&t, 1, bf16); nc = 1; })

PP_FPANEL_GEMM(pp_fpanel_gemm_avx2, T256,
               if (left >= 3) { tile256(&t, 3, bf16); nc = 3; }
               else if (left >= 2) { tile256(&t, 2, bf16); nc = 2; }
               else { tile256(&t, 1, bf16); nc = 1; })

/* BF16 weights where the CPU has AVX-512 BF16 (and rows short enough for
 * the rounded columns' scratch); otherwise the FMA kernel. */
void pp_fpanel_gemm_bf16_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                                    size_t stride, int64_t n, float *out, size_t ldo) {
    if (w->k <= PP_PANEL_K_MAX_K && pp_fpanel_bf16_dot_runs_here())
        bf16_gemm_avx512vnni(w, p0, p1, cols, stride, n, out, ldo);
    else
        pp_fpanel_gemm_avx512vnni(w, p0, p1, cols, stride, n, out, ldo);
}
#endif

int pp_fpanel_bf16_dot_runs_here(void) {
#if defined(__x86_64__)
    if (getenv("PYLLAMA_PAGED_BF16_DOT") && strcmp(getenv("PYLLAMA_PAGED_BF16_DOT"), "0") == 0) return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}
