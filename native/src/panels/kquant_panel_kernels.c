/* The SIMD kernels of the K-panel GEMM (panel_formats.h, kquant_panels.c),
 * compiled per function for their instruction sets like
 * q8_panel_kernels.c.
 *
 * Few columns are read straight from the stored panel: each 32-value
 * block is decoded once in registers and tiles of up to four columns
 * (two on 16-register AVX2) run over it. Many columns (20 with AVX-512
 * VNNI, 8 otherwise: measured crossovers on the 1.6B file) widen each
 * panel once with AVX2 (codes and scales) into this thread's scratch, then
 * tiles of columns run over it while it stays in L1/L2. Per 32-value block
 * and column, eight dot-product instructions (8 rows x 4 bytes each), then:
 *   Q4_K, Q5_K: acc * (d sc x column scale) - (dmin m) x (column scale x
 *         byte sum);
 *   Q6_K: two half-block accumulators, each started at -32 x its half's
 *         byte sum, each times (d sc of its 16 values x column scale).
 * AVX2 without VNNI forms the same dot products with maddubs (unsigned
 * codes x signed bytes, pairs summed in 16 bits: at most 2 x 63 x 127, no
 * saturation for codes below 64: Q4_K's, Q5_K's and Q6_K's) and a
 * multiply-add of the pairs. */
#include "panels/panel_formats.h"

/* The direct path asks for the superblock two ahead, a block's share of its
 * lines per block: the hardware prefetcher alone left decode steps waiting
 * on memory (4 sequences on the 1.6B file: 61 -> 53 ms, 8: 128 -> 110; one
 * ahead or three gained less). */
#define PF_AHEAD 2

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

static inline int32_t load_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* v's bits moved left by shift (right where it is negative), then masked.
 * 16-bit shifts by at most 4 carry bits across bytes only into positions
 * the masks drop. */
static inline __attribute__((target("avx2"), always_inline)) __m256i shift_bits(__m256i v, int shift, __m256i mask) {
    if (shift > 0) v = _mm256_slli_epi16(v, shift);
    if (shift < 0) v = _mm256_srli_epi16(v, -shift);
    return _mm256_and_si256(v, mask);
}

/* The fifth (Q5_K) or fifth and sixth (Q6_K) bits of a block's eight code
 * groups, at bits 4 (and 5) of each byte. */
static inline __attribute__((target("avx2"), always_inline)) void kpanel_high_bits(enum ggml_type type,
                                                                                   const uint8_t *blk, __m256i hi[8]) {
    if (type == GGML_TYPE_Q5_K) {
        /* group g's fifth bit: byte t of the 32, bit g, moved up to bit 4 */
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128));
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) hi[g] = shift_bits(h, 4 - g, bit4);
    } else {
        /* group g's two high bits: byte (32 g + t) % 64, bits 2 (g / 2), moved to bits 4 and 5 */
        const __m256i high2 = _mm256_set1_epi8(0x30);
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(blk + 128));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(blk + 160));
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) hi[g] = shift_bits(g % 2 ? h1 : h0, 4 - 2 * (g / 2), high2);
    }
}

/* A block's 256 codes as eight vectors of groups (nibbles and high bits). */
static inline __attribute__((target("avx2"), always_inline)) void kpanel_block_codes(enum ggml_type type,
                                                                                     const uint8_t *blk, __m256i wv[8]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == GGML_TYPE_Q4_K) {
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * g));
            wv[g] = _mm256_and_si256(v, low4);
            wv[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        return;
    }
    __m256i hi[8];
    kpanel_high_bits(type, blk, hi);
    for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * g));
        wv[g] = _mm256_or_si256(_mm256_and_si256(v, low4), hi[g]);
        wv[g + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), hi[g + 4]);
    }
}

__attribute__((target("avx2"))) void pp_kpanel_widen_codes_avx2(const pp_q8_panels *w, int64_t pi, uint8_t *codes) {
    const int64_t nsb = w->k / PP_PANEL_KBLOCK;
    const size_t hb = pp_kpanel_header_bytes(w->type), cb = pp_kpanel_block_bytes(w->type);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = pp_kpanel_superblock(w, pi, s);
        for (int b = 0; b < 8; b++) {
            uint8_t *dst = codes + (size_t)(8 * s + b) * 256;
            __m256i wv[8];
            kpanel_block_codes(w->type, sb + hb + (size_t)b * cb, wv);
            for (int g = 0; g < 8; g++) _mm256_storeu_si256((__m256i *)(dst + 32 * g), wv[g]);
        }
    }
}

/* pp_kpanel_widen_scales with 8 rows per vector: the same products. */
__attribute__((target("avx2,fma,f16c"))) void pp_kpanel_widen_scales_avx2(const pp_q8_panels *w, int64_t pi,
                                                                          pp_kpanel *out) {
    const int64_t nsb = w->k / PP_PANEL_KBLOCK;
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = pp_kpanel_superblock(w, pi, s);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        if (w->type != GGML_TYPE_Q6_K) {
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16)));
            for (int b = 0; b < 8; b++) {
                const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 32 + 8 * b)));
                const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 96 + 8 * b)));
                _mm256_store_ps(out->scale + (8 * s + b) * 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
                _mm256_store_ps(out->min + (8 * s + b) * 8, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)));
            }
        } else {
            for (int q = 0; q < 16; q++) {
                const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 16 + 8 * q)));
                _mm256_store_ps(out->scale + (16 * s + q) * 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
            }
        }
    }
}

/* A tile's NC columns, from cols every col_stride bytes: each one's codes
 * (qc), block scales (csc), scaled byte sums (ssc) and half-block offsets
 * (ofc), formed once per tile rather than per block; its accumulators
 * (accf, declared by the caller) zeroed. */
#define PP_KTILE_COLUMNS(NC)                                                                                \
    const uint8_t *qc[NC];                                                                                  \
    const float *csc[NC], *ssc[NC];                                                                         \
    const int32_t *ofc[NC];                                                                                 \
    _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) {                                                  \
        accf[i] = _mm256_setzero_ps();                                                                      \
        qc[i] = cols + i * col_stride;                                                                      \
        csc[i] = PP_COL_SCALE(qc[i], k);                                                                    \
        ssc[i] = PP_COL_SSUM(qc[i], k);                                                                     \
        ofc[i] = PP_COL_OFFSET16(qc[i], k);                                                                 \
    }

/* NC columns straight from a stored panel, nothing widened: decode of a
 * few streams reads each weight byte from memory once per step. Each
 * block's codes are unpacked once in registers and its scales formed once,
 * then every column of the tile runs its dot products over them (one column
 * at a time decoded the panel NC times: a decode step of 4 sequences on the
 * 1.6B file took 100 ms, now 63). The columns' addresses are formed once
 * per tile (worth 76 -> 63 ms). Two chains per column: values 0..15 and
 * 16..31 of the block, Q6_K's two half-block scales. */
#define PP_KDIRECT(NAME, TARGET, DOT, NC)                                                                   \
    static inline __attribute__((target(TARGET), always_inline)) void NAME(                                 \
        const pp_q8_panels *w, int64_t pi, const uint8_t *cols, size_t col_stride, float *out, size_t ldo) { \
        const int64_t k = w->k, nsb = k / PP_PANEL_KBLOCK;                                                  \
        const int q6 = w->type == GGML_TYPE_Q6_K;                                                           \
        const size_t hb = pp_kpanel_header_bytes(w->type), cb = pp_kpanel_block_bytes(w->type);                   \
        __m256 accf[NC];                                                                                    \
        PP_KTILE_COLUMNS(NC)                                                                                \
        const uint8_t *sb = pp_kpanel_superblock(w, pi, 0);                                                 \
        const size_t sb_bytes = pp_kpanel_superblock_bytes(w->type);                                        \
        for (int64_t s = 0; s < nsb; s++, sb += sb_bytes) {                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));                         \
            for (int b = 0; b < 8; b++) {                                                                   \
                const int64_t bb = 8 * s + b;                                                               \
                __m256i wv[8];                                                                              \
                __m256 a0, a1;                                                                              \
                for (size_t l = 0; l < sb_bytes / 8 + 64; l += 64)                                          \
                    _mm_prefetch((const char *)(sb + PF_AHEAD * sb_bytes + b * (sb_bytes / 8) + l), _MM_HINT_T0); \
                kpanel_block_codes(w->type, sb + hb + cb * b, wv);                                          \
                if (q6) {                                                                                   \
                    a0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                          \
                                              _mm_loadl_epi64((const __m128i *)(sb + 16 + 16 * b)))));      \
                    a1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                          \
                                              _mm_loadl_epi64((const __m128i *)(sb + 24 + 16 * b)))));      \
                } else {                                                                                    \
                    a0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(                          \
                                              _mm_loadl_epi64((const __m128i *)(sb + 32 + 8 * b)))));       \
                    a1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16))),        \
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(                             \
                                           _mm_loadl_epi64((const __m128i *)(sb + 96 + 8 * b)))));          \
                }                                                                                           \
                _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) {                                      \
                    const uint8_t *q = qc[i] + 32 * bb;                                                     \
                    __m256i acc0 = q6 ? _mm256_set1_epi32(ofc[i][2 * bb]) : _mm256_setzero_si256();        \
                    __m256i acc1 = q6 ? _mm256_set1_epi32(ofc[i][2 * bb + 1]) : _mm256_setzero_si256();    \
                    _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                                   \
                        acc0 = DOT(acc0, wv[g], _mm256_set1_epi32(load_i32(q + 4 * g)));                    \
                        acc1 = DOT(acc1, wv[g + 4], _mm256_set1_epi32(load_i32(q + 16 + 4 * g)));           \
                    }                                                                                       \
                    const __m256 cs = _mm256_set1_ps(csc[i][bb]);                                           \
                    if (q6) {                                                                               \
                        accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc0), _mm256_mul_ps(a0, cs), accf[i]); \
                        accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc1), _mm256_mul_ps(a1, cs), accf[i]); \
                    } else {                                                                                \
                        accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc0, acc1)),         \
                                                  _mm256_mul_ps(a0, cs), accf[i]);                          \
                        accf[i] = _mm256_fnmadd_ps(a1, _mm256_set1_ps(ssc[i][bb]), accf[i]);                \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) _mm256_storeu_ps(out + i * ldo, accf[i]);     \
    }

/* NC columns of one widened panel. Q4_K splits each column's chain in
 * SPLIT (narrow tiles: the dot products' latency); Q6_K has its two
 * half-block chains anyway. */
#define PP_KTILE(NAME, TARGET, DOT, NC, SPLIT, Q6)                                                          \
    static inline __attribute__((target(TARGET), always_inline)) void NAME(                                 \
        const pp_kpanel *p, int64_t nb, int64_t k, const uint8_t *cols, size_t col_stride, float *out,      \
        size_t ldo) {                                                                                       \
        enum { NACC = (Q6) ? 2 : (SPLIT) };                                                                 \
        __m256 accf[NC];                                                                                    \
        PP_KTILE_COLUMNS(NC)                                                                                \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            const uint8_t *blk = p->codes + b * 256;                                                        \
            __m256i acci[NC][NACC];                                                                         \
            _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++)                                            \
                _Pragma("GCC unroll 2") for (int s = 0; s < NACC; s++) acci[i][s] = (Q6)                    \
                    ? _mm256_set1_epi32(ofc[i][2 * b + s]) : _mm256_setzero_si256();                        \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                           \
                const __m256i wv = _mm256_load_si256((const __m256i *)(blk + 32 * j));                      \
                const int s = (Q6) ? j / 4 : j % NACC;                                                      \
                _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) acci[i][s] = DOT(                      \
                    acci[i][s], wv, _mm256_set1_epi32(load_i32(qc[i] + 32 * b + 4 * j)));                  \
            }                                                                                               \
            _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) {                                          \
                const __m256 cs = _mm256_set1_ps(csc[i][b]);                                                \
                if (Q6) {                                                                                   \
                    _Pragma("GCC unroll 2") for (int s = 0; s < 2; s++) accf[i] = _mm256_fmadd_ps(          \
                        _mm256_cvtepi32_ps(acci[i][s]),                                                     \
                        _mm256_mul_ps(_mm256_load_ps(p->scale + (2 * b + s) * 8), cs), accf[i]);            \
                } else {                                                                                    \
                    __m256i sum = acci[i][0];                                                               \
                    _Pragma("GCC unroll 2") for (int s = 1; s < NACC; s++) sum = _mm256_add_epi32(sum, acci[i][s]); \
                    accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),                                      \
                                              _mm256_mul_ps(_mm256_load_ps(p->scale + b * 8), cs), accf[i]); \
                    accf[i] = _mm256_fnmadd_ps(_mm256_load_ps(p->min + b * 8),                              \
                                               _mm256_set1_ps(ssc[i][b]), accf[i]);                         \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) _mm256_storeu_ps(out + i * ldo, accf[i]);     \
    }

#define PP_KPANEL_COLUMNS(NAME, P, NB, K, COLS, STRIDE, N, O, LDO, NC_MAIN)                                \
    do {                                                                                                    \
        int64_t c = 0;                                                                                      \
        for (; c + NC_MAIN <= (N); c += NC_MAIN) NAME##_main(P, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO); \
        for (; c + 4 <= (N); c += 4) NAME##_four(P, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO); \
        for (; c < (N); c++) NAME##_one(P, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO);    \
    } while (0)

#define PP_KPANEL_KERNEL(NAME, TARGET, DOT, NC_MAIN, NC_DIRECT, WIDEN_FROM)                                \
    PP_KDIRECT(NAME##_direct_main, TARGET, DOT, NC_DIRECT)                                                  \
    PP_KDIRECT(NAME##_direct_two, TARGET, DOT, 2)                                                           \
    PP_KDIRECT(NAME##_direct_one, TARGET, DOT, 1)                                                           \
    PP_KTILE(NAME##_q4_main, TARGET, DOT, NC_MAIN, 1, 0)                                                    \
    PP_KTILE(NAME##_q4_four, TARGET, DOT, 4, 1, 0)                                                          \
    PP_KTILE(NAME##_q4_one, TARGET, DOT, 1, 2, 0)                                                           \
    PP_KTILE(NAME##_q6_main, TARGET, DOT, NC_MAIN, 2, 1)                                                    \
    PP_KTILE(NAME##_q6_four, TARGET, DOT, 4, 2, 1)                                                          \
    PP_KTILE(NAME##_q6_one, TARGET, DOT, 1, 2, 1)                                                           \
    PP_PANEL_GEMM_KERNEL(NAME, TARGET) {                                                                \
        const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;                                                    \
        pp_kpanel p = pp_kpanel_scratch();                                                                  \
        for (int64_t pi = p0; pi < p1; pi++) {                                                              \
            float *o = out + (size_t)pi * PP_PANEL_ROWS;                                                    \
            if (n < WIDEN_FROM) {                                                                           \
                int64_t c = 0;                                                                              \
                for (; c + NC_DIRECT <= n; c += NC_DIRECT)                                                  \
                    NAME##_direct_main(w, pi, cols + c * col_stride, col_stride, o + c * ldo, ldo);         \
                for (; c + 2 <= n; c += 2)                                                                  \
                    NAME##_direct_two(w, pi, cols + c * col_stride, col_stride, o + c * ldo, ldo);          \
                for (; c < n; c++) NAME##_direct_one(w, pi, cols + c * col_stride, col_stride, o + c * ldo, ldo); \
                continue;                                                                                   \
            }                                                                                               \
            pp_kpanel_widen_scales_avx2(w, pi, &p);                                                         \
            pp_kpanel_widen_codes_avx2(w, pi, p.codes);                                                     \
            if (w->type == GGML_TYPE_Q6_K)                                                                  \
                PP_KPANEL_COLUMNS(NAME##_q6, &p, nb, k, cols, col_stride, n, o, ldo, NC_MAIN);              \
            else                                                                                            \
                PP_KPANEL_COLUMNS(NAME##_q4, &p, nb, k, cols, col_stride, n, o, ldo, NC_MAIN);              \
        }                                                                                                   \
    }

static inline __attribute__((target("avx2"), always_inline)) __m256i dot_avx2(__m256i acc, __m256i w, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

PP_KPANEL_KERNEL(pp_kpanel_gemm_avx512vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni", _mm256_dpbusd_epi32, 8, 4, 20)
PP_KPANEL_KERNEL(pp_kpanel_gemm_avxvnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32, 4, 2, 8)
PP_KPANEL_KERNEL(pp_kpanel_gemm_avx2, "avx2,fma,f16c", dot_avx2, 4, 2, 8)

#endif
