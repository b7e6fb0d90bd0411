/* The tile both 8-row panel families multiply with (q8_panel_kernels.c:
 * Q8_0, Q5_0 and Q4_0; mxfp4_panel_kernels.c: MXFP4), for files compiled
 * per function for their instruction sets. Included only on x86-64.
 *
 * A tile is one panel (8 rows, one per lane) by NC activation columns. Per
 * block: SCALES(blk) gives the 8 rows' f32 scales; per column the integer
 * accumulator starts at OFFSET(o), o the column's stored offset (-128 x the
 * block's byte sum), and eight DOT products add 8 rows x 4 bytes each (the
 * column's four bytes broadcast) of the code groups GROUP(blk, j); one
 * convert and one FMA apply the rows' scales times the column's. SPLIT
 * chains per column (narrow tiles: the dot products' latency). PF_BYTES > 0:
 * the tile reads stored panels straight from memory (decode), so it asks for
 * the bytes PF_BYTES ahead, every line of them; 0 over a panel hot in L1. */
#ifndef PP_PANEL_TILE_H
#define PP_PANEL_TILE_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline int32_t pp_load_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float pp_load_f32(const uint8_t *p) {
    float v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define PP_PANEL_TILE(NAME, TARGET, DOT, NC, SPLIT, BLOCK_BYTES, SCALES, OFFSET, GROUP, PF_BYTES)          \
    static inline __attribute__((target(TARGET), always_inline)) void NAME(                                 \
        const uint8_t *panel, int64_t nb, int64_t k, const uint8_t *cols, size_t col_stride, float *out,    \
        size_t ldo) {                                                                                       \
        __m256 accf[NC];                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) accf[i] = _mm256_setzero_ps();                \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            const uint8_t *blk = panel + b * (BLOCK_BYTES);                                                 \
            if (PF_BYTES)                                                                                   \
                _Pragma("GCC unroll 8") for (int off = 0; off < (BLOCK_BYTES); off += 64)                   \
                    _mm_prefetch((const char *)blk + (PF_BYTES) + off, _MM_HINT_T0);                        \
            const __m256 dw = SCALES(blk);                                                                  \
            __m256i acci[NC][SPLIT];                                                                        \
            _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) {                                          \
                acci[i][0] = _mm256_set1_epi32(OFFSET(pp_load_i32(cols + i * col_stride + k + 4 * nb + 4 * b))); \
                _Pragma("GCC unroll 2") for (int s = 1; s < SPLIT; s++) acci[i][s] = _mm256_setzero_si256(); \
            }                                                                                               \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                           \
                const __m256i wv = GROUP(blk, j);                                                           \
                _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) acci[i][j % SPLIT] = DOT(              \
                    acci[i][j % SPLIT], wv, _mm256_set1_epi32(pp_load_i32(cols + i * col_stride + 32 * b + 4 * j))); \
            }                                                                                               \
            _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) {                                          \
                __m256i sum = acci[i][0];                                                                   \
                _Pragma("GCC unroll 2") for (int s = 1; s < SPLIT; s++) sum = _mm256_add_epi32(sum, acci[i][s]); \
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(pp_load_f32(cols + i * col_stride + k + 4 * b))); \
                accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, accf[i]);                         \
            }                                                                                               \
        }                                                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < NC; i++) _mm256_storeu_ps(out + i * ldo, accf[i]);     \
    }

/* The tile widths a kernel walks a panel's columns with: NC_MAIN, 4, 2 and 1
 * (NAME##_main, _four, _two, _one); the narrow ones in two chains. */
#define PP_PANEL_TILES(NAME, TARGET, DOT, NC_MAIN, BLOCK_BYTES, SCALES, OFFSET, GROUP, PF_BYTES)                \
    PP_PANEL_TILE(NAME##_main, TARGET, DOT, NC_MAIN, 1, BLOCK_BYTES, SCALES, OFFSET, GROUP, PF_BYTES)           \
    PP_PANEL_TILE(NAME##_four, TARGET, DOT, 4, 1, BLOCK_BYTES, SCALES, OFFSET, GROUP, PF_BYTES)                 \
    PP_PANEL_TILE(NAME##_two, TARGET, DOT, 2, 2, BLOCK_BYTES, SCALES, OFFSET, GROUP, PF_BYTES)                  \
    PP_PANEL_TILE(NAME##_one, TARGET, DOT, 1, 2, BLOCK_BYTES, SCALES, OFFSET, GROUP, PF_BYTES)

/* N columns of one panel through NAME's tiles, widest first. */
#define PP_PANEL_COLUMNS(NAME, PANEL, NB, K, COLS, STRIDE, N, O, LDO, NC_MAIN)                                 \
    do {                                                                                                    \
        int64_t c = 0;                                                                                      \
        for (; c + NC_MAIN <= (N); c += NC_MAIN) NAME##_main(PANEL, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO); \
        for (; c + 4 <= (N); c += 4) NAME##_four(PANEL, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO); \
        for (; c + 2 <= (N); c += 2) NAME##_two(PANEL, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO); \
        for (; c < (N); c++) NAME##_one(PANEL, NB, K, (COLS) + c * (STRIDE), STRIDE, (O) + c * (LDO), LDO); \
    } while (0)

#endif
