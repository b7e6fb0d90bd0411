/* The VNNI kernels of the panel GEMM (panel_formats.h), compiled per function
 * for their instruction sets so the library itself stays x86-64 baseline;
 * pp_panel_kernel_select picks one only where the CPU has it.
 *
 * A tile is one panel (8 rows, one per lane) by NC activation columns. Per
 * block and column: the accumulator starts at the column's offset term,
 * eight dot-product instructions add 8 rows x 4 bytes each (the column's
 * four bytes broadcast), then one convert and one FMA apply the rows'
 * scales times the column's. Wide tiles give independent dependency chains;
 * narrow ones (the last few columns, single-sequence decode) split each
 * column's chain in two. */
#include "panels/panel_formats.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#include "panels/panel_tile.h"

/* Group j of a block's codes for the tile: Q8 panels (and widened ones)
 * store it as 32 bytes; Q4_0 panels hold groups j and j + 4 as the low and
 * high nibbles of the same 32 bytes, taken as q (0..15), value q - 8. */
static inline __attribute__((target("avx2"), always_inline)) __m256i q8_group(const uint8_t *blk, int j) {
    return _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
}

static inline __attribute__((target("avx2"), always_inline)) __m256i q4_group(const uint8_t *blk, int j) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (j % 4)));
    return _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

/* The rows' scales: a block's first 16 bytes, 8 f16. The accumulator
 * starts at -128 x the column's byte sum for codes q + 128 (Q8 panels and
 * widened ones), -8 x it for Q4_0's q (exact: the stored offset over 16). */
static inline __attribute__((target("avx2,f16c"), always_inline)) __m256 f16_scales(const uint8_t *blk) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
}
#define q8_offset(o) (o)
#define q4_offset(o) ((o) / 16)

/* Q4_0 panels are read straight (q4 tiles) below this many columns; from it
 * on each panel is widened once (widen_q4_avx2) and the column tiles run
 * over the widened bytes: 512 columns took 10% longer straight. */
#define PP_Q4_WIDEN_COLUMNS 16

/* How far ahead the straight tiles prefetch: consecutive panels are
 * contiguous, so this runs on into the next panel. The hardware prefetcher
 * alone left single-stream decode of a Q4_0 file at 0.87x llama-bench's. */
#define PP_Q8_PF_BYTES 2048

#define PP_PANEL_KERNEL(NAME, TARGET, DPBUSD, NC_MAIN, WIDEN)                                               \
    PP_PANEL_TILES(NAME, TARGET, DPBUSD, NC_MAIN, PP_PANEL_BLOCK_BYTES, f16_scales, q8_offset, q8_group, 0) \
    PP_PANEL_TILES(NAME##_q4, TARGET, DPBUSD, NC_MAIN, PP_PANEL_Q4_BLOCK_BYTES, f16_scales, q4_offset, q4_group, PP_Q8_PF_BYTES) \
    PP_PANEL_GEMM_KERNEL(NAME, TARGET) {                                                                \
        const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;                                                    \
        _Alignas(64) uint8_t tmp[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_BLOCK_BYTES];                   \
        for (int64_t pi = p0; pi < p1; pi++) {                                                              \
            float *o = out + (size_t)pi * PP_PANEL_ROWS;                                                    \
            if (w->type == GGML_TYPE_Q4_0 && n < PP_Q4_WIDEN_COLUMNS) {                                     \
                const uint8_t *q4 = w->data + (size_t)pi * nb * PP_PANEL_Q4_BLOCK_BYTES;                    \
                PP_PANEL_COLUMNS(NAME##_q4, q4, nb, k, cols, col_stride, n, o, ldo, NC_MAIN);               \
                continue;                                                                                   \
            }                                                                                               \
            const uint8_t *panel = w->data + (size_t)pi * nb * PP_PANEL_BLOCK_BYTES;                        \
            if (w->type == GGML_TYPE_Q5_0) {                                                                \
                WIDEN(w->data + (size_t)pi * nb * PP_PANEL_Q5_BLOCK_BYTES, nb, tmp);                        \
                panel = tmp;                                                                                \
            } else if (w->type == GGML_TYPE_Q4_0) {                                                         \
                widen_q4_avx2(w->data + (size_t)pi * nb * PP_PANEL_Q4_BLOCK_BYTES, nb, tmp);                \
                panel = tmp;                                                                                \
            }                                                                                               \
            PP_PANEL_COLUMNS(NAME, panel, nb, k, cols, col_stride, n, o, ldo, NC_MAIN);                     \
        }                                                                                                   \
    }

/* Q5_0 panel -> compute layout: per 32-byte group, the low nibbles (bytes
 * i % 128, high half for i >= 128) or 0x70, plus 0x10 where the fifth bit
 * is set: q + 112 = (q - 16) + 128. ADD_FIFTH(v, bits) is that addition. */
#define PP_WIDEN_Q5(NAME, TARGET, ADD_FIFTH)                                                                \
    static inline __attribute__((target(TARGET), always_inline)) void NAME(const uint8_t *panel, int64_t nb, \
                                                                          uint8_t *out) {                   \
        const __m256i low4 = _mm256_set1_epi8(0x0F), base = _mm256_set1_epi8(0x70);                         \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            const uint8_t *src = panel + (size_t)b * PP_PANEL_Q5_BLOCK_BYTES;                               \
            uint8_t *dst = out + (size_t)b * PP_PANEL_BLOCK_BYTES;                                          \
            memcpy(dst, src, 16);                                                                           \
            for (int g = 0; g < 4; g++) {                                                                   \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 16 + 32 * g));                 \
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), base);                        \
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), base);  \
                _mm256_storeu_si256((__m256i *)(dst + 16 + 32 * g), ADD_FIFTH(lo, src + 144 + 4 * g));      \
                _mm256_storeu_si256((__m256i *)(dst + 16 + 32 * (g + 4)), ADD_FIFTH(hi, src + 144 + 4 * (g + 4))); \
            }                                                                                               \
        }                                                                                                   \
    }

/* AVX-512: add under the 32 bits taken as a byte mask. */
static inline __attribute__((target("avx2,avx512f,avx512vl,avx512bw"), always_inline)) __m256i add_fifth_avx512(
    __m256i v, const uint8_t *bits) {
    return _mm256_mask_add_epi8(v, _cvtu32_mask32((uint32_t)pp_load_i32(bits)), v, _mm256_set1_epi8(0x10));
}

/* AVX2: each bit spread to its byte by a shuffle (byte k takes source byte
 * k / 8), then tested against 1 << k % 8. */
static inline __attribute__((target("avx2"), always_inline)) __m256i add_fifth_avx2(__m256i v, const uint8_t *bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(pp_load_i32(bits)),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_add_epi8(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

PP_WIDEN_Q5(widen_q5_avx512, "avx2,avx512f,avx512vl,avx512bw", add_fifth_avx512)
PP_WIDEN_Q5(widen_q5_avx2, "avx2", add_fifth_avx2)

/* Q4_0 panel -> compute layout: the nibbles as Q5_0's, plus 120: q + 120 =
 * (q - 8) + 128. */
static inline __attribute__((target("avx2"), always_inline)) void widen_q4_avx2(const uint8_t *panel, int64_t nb,
                                                                               uint8_t *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), base = _mm256_set1_epi8(120);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + (size_t)b * PP_PANEL_Q4_BLOCK_BYTES;
        uint8_t *dst = out + (size_t)b * PP_PANEL_BLOCK_BYTES;
        memcpy(dst, src, 16);
        for (int g = 0; g < 4; g++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 16 + 32 * g));
            _mm256_storeu_si256((__m256i *)(dst + 16 + 32 * g), _mm256_add_epi8(_mm256_and_si256(v, low4), base));
            _mm256_storeu_si256((__m256i *)(dst + 16 + 32 * (g + 4)),
                                _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), base));
        }
    }
}

/* AVX-512 VNNI on 256-bit registers (AVX512VL): 32 registers hold 8 columns. */
PP_PANEL_KERNEL(pp_panel_gemm_avx512vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni", _mm256_dpbusd_epi32, 8,
                widen_q5_avx512)
/* AVX-VNNI (Alder Lake and later, Zen 5): 16 registers, 4 columns. */
PP_PANEL_KERNEL(pp_panel_gemm_avxvnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32, 4, widen_q5_avx2)

/* quantize_column of q8_panels.c on AVX2: the same bytes (GGML's x86
 * quantizer: reciprocal 127 / amax, products rounded to nearest even). */
__attribute__((target("avx2,fma,f16c"))) void pp_panel_quantize_column_avx2(const float *x, int64_t k, uint8_t *col) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    int8_t *q = (int8_t *)col;
    float *scale = (float *)(col + k);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * PP_PANEL_BLOCK + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float m = _mm_cvtss_f32(h);
        const float d = m / 127.0f, id = m != 0.0f ? 127.0f / m : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            qi[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs interleave 128-bit lanes: restore the order with one permute */
        const __m256i q16a = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * PP_PANEL_BLOCK), q8);
        /* the two 16-value halves' sums (values 0-15: qi[0], qi[1]): horizontal adds
         * within each 128-bit lane leave [h0, h1, h0, h1] per lane, then the lanes add */
        const __m256i pairs = _mm256_hadd_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        const __m256i hh = _mm256_hadd_epi32(pairs, pairs);
        const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(hh), _mm256_extracti128_si256(hh, 1));
        const float dh = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        memcpy(scale + b, &dh, sizeof dh);
        pp_panel_column_sums(col, k, b, dh, _mm_cvtsi128_si32(s2), _mm_extract_epi32(s2, 1));
    }
}

#endif
