/* The SIMD kernels of the MXFP4-panel GEMM (panel_formats.h, mxfp4_panels.c),
 * compiled per function for their instruction sets like q8_panel_kernels.c.
 *
 * A tile is one panel (8 rows, one per lane) by NC activation columns, as
 * the Q8 panels' tiles. Per block: the rows' exponents become 8 f32 scales
 * 2^(e - 128) by integer shifts into the float bits; each 32-byte group of
 * codes is a nibble mask and one byte shuffle (the 16 codes' doubled values
 * plus PP_MX_CODE_BIAS, a table in a register) away from unsigned bytes;
 * per column, the accumulator starts at -bias x the block's byte sum (from
 * the column's offset, -128 x that sum), eight dot products add 8 rows x 4
 * bytes each, then one convert and one FMA apply the scales. VNNI forms the
 * dot products with DPBUSD; AVX2 with maddubs (biased codes 0..24 times
 * bytes of at most 127: pairs within 16 bits) and a multiply-add of the
 * pairs.
 *
 * Few columns (decode) run straight from the stored panel, decoding each
 * group once per tile of 8 (or 4), 4, 2 or 1 columns: a decode step of 16
 * sequences routes 2 or 3 columns to most of gpt-oss's experts, and the
 * two-column tile took that step from about 70 to 60 ms (a reduced-width
 * synthetic gpt-oss-20b).
 * From PP_MX_WIDEN_COLUMNS on, each panel is widened once (scales and
 * codes, PP_PANEL_MX_WIDE_BYTES a block) on the stack and the tiles read
 * plain loads from it. */
#include "panels/panel_formats.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

/* From this many columns a panel is widened first; below, read straight:
 * Q4_0 panels' crossover (q8_panel_kernels.c), whose straight groups cost
 * the same but for the shuffle. A 256-token prefill of the reduced-width
 * file was within the machine's noise at 4, 16 and never. */
#define PP_MX_WIDEN_COLUMNS 16

/* How far ahead the straight tiles prefetch, as the Q8 panels' do. */
#define PP_MX_PF_BYTES 2048

#include "panels/panel_tile.h"

/* 2^(e - 128) for the 8 rows' exponent bytes at e8: e >= 2 is the float of
 * biased exponent e - 1; e = 0 and 1 are the denormals 2^-128 and 2^-127,
 * bit 21 or 22 of the mantissa. */
static inline __attribute__((target("avx2"), always_inline)) __m256 mx_scales(const uint8_t *e8) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i is_denormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, is_denormal));
}

/* Code -> its doubled value plus the bias, in both 128-bit lanes. */
static inline __attribute__((target("avx2"), always_inline)) __m256i mx_code_table(void) {
    return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
}

/* Group j of a stored block: groups j and j + 4 are the low and high
 * nibbles of the same 32 bytes. */
static inline __attribute__((target("avx2"), always_inline)) __m256i stored_group(const uint8_t *blk, int j) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + PP_PANEL_ROWS + 32 * (j % 4)));
    const __m256i code = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(mx_code_table(), code);
}

static inline __attribute__((target("avx2"), always_inline)) __m256 stored_scales(const uint8_t *blk) {
    return mx_scales(blk);
}

static inline __attribute__((target("avx2"), always_inline)) __m256i wide_group(const uint8_t *blk, int j) {
    return _mm256_load_si256((const __m256i *)(blk + 32 + 32 * j));
}

static inline __attribute__((target("avx2"), always_inline)) __m256 wide_scales(const uint8_t *blk) {
    return _mm256_load_ps((const float *)blk);
}

/* A stored panel widened for the wide tiles (out 32-byte aligned). */
static inline __attribute__((target("avx2"), always_inline)) void widen(const uint8_t *panel, int64_t nb,
                                                                       uint8_t *out) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + (size_t)b * PP_PANEL_MX_BLOCK_BYTES;
        uint8_t *dst = out + (size_t)b * PP_PANEL_MX_WIDE_BYTES;
        _mm256_store_ps((float *)dst, mx_scales(src));
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(dst + 32 + 32 * j), stored_group(src, j));
    }
}

/* The accumulator starts at -bias x the column's byte sum: its stored
 * offset, -128 x that sum, is exact in 128ths. */
#define mx_offset(o) ((o) / 128 * PP_MX_CODE_BIAS)

#define PP_MX_KERNEL(NAME, TARGET, DOT, NC_MAIN)                                                            \
    PP_PANEL_TILES(NAME##_stored, TARGET, DOT, NC_MAIN, PP_PANEL_MX_BLOCK_BYTES, stored_scales, mx_offset, stored_group, PP_MX_PF_BYTES) \
    PP_PANEL_TILES(NAME##_wide, TARGET, DOT, NC_MAIN, PP_PANEL_MX_WIDE_BYTES, wide_scales, mx_offset, wide_group, 0) \
    PP_PANEL_GEMM_KERNEL(NAME, TARGET) {                                                                \
        const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;                                                    \
        _Alignas(64) uint8_t wide[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_MX_WIDE_BYTES];                \
        for (int64_t pi = p0; pi < p1; pi++) {                                                              \
            float *o = out + (size_t)pi * PP_PANEL_ROWS;                                                    \
            const uint8_t *stored = w->data + (size_t)pi * nb * PP_PANEL_MX_BLOCK_BYTES;                    \
            if (n < PP_MX_WIDEN_COLUMNS) {                                                                  \
                PP_PANEL_COLUMNS(NAME##_stored, stored, nb, k, cols, col_stride, n, o, ldo, NC_MAIN);          \
                continue;                                                                                   \
            }                                                                                               \
            widen(stored, nb, wide);                                                                        \
            PP_PANEL_COLUMNS(NAME##_wide, wide, nb, k, cols, col_stride, n, o, ldo, NC_MAIN);                  \
        }                                                                                                   \
    }

static inline __attribute__((target("avx2"), always_inline)) __m256i dot_avx2(__m256i acc, __m256i w, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

/* AVX-512 VNNI on 256-bit registers (AVX512VL): 32 registers hold 8 columns. */
PP_MX_KERNEL(pp_mxpanel_gemm_avx512vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni", _mm256_dpbusd_epi32, 8)
/* AVX-VNNI (Alder Lake and later, Zen 5): 16 registers, 4 columns. */
PP_MX_KERNEL(pp_mxpanel_gemm_avxvnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32, 4)
/* AVX2 without VNNI: maddubs, 4 columns. */
PP_MX_KERNEL(pp_mxpanel_gemm_avx2, "avx2,fma,f16c", dot_avx2, 4)

#endif
