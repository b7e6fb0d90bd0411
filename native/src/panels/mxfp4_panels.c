/* MXFP4 panels (panel_formats.h): gpt-oss's expert weights in 8-row panels
 * for the panel GEMM. Packing, a row read back and the portable kernel; the
 * SIMD kernels are in mxfp4_panel_kernels.c.
 *
 * An MXFP4 block is 32 values sharing one E8M0 exponent e (scale 2^(e -
 * 127)), each value a 4-bit E2M1 code: a sign bit over the magnitudes 0,
 * 0.5, 1, 1.5, 2, 3, 4, 6. Twice those are the integers 0..12, so a code
 * is an integer byte for the same dot products the other formats run, and
 * the block's scale is halved to 2^(e - 128). GGML's own MXFP4 product
 * quantizes its activations to Q8_0, as the panels' columns are.
 *
 * Stored layout, per panel and 32-value block (136 bytes, the 8 rows' 17
 * bytes of the file, moved): e[8 rows], then 128 bytes of codes, code i of
 * the block's compute layout (i = 32j + 4r + t: group j, row r, row value
 * 4j + t) in byte i % 128, the high nibble for i >= 128. GGML's block holds
 * value t (< 16) in the low nibble of its byte t and value t + 16 in the
 * high one, so each 4-byte group of the row's bytes moves whole, as Q4_0's
 * do into Q4_0 panels. */
#include "panels/panel_formats.h"

#include <math.h>
#include <string.h>

const int8_t pp_mx_doubled_value[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

float pp_mx_half_scale(uint8_t e) {
    return ldexpf(1.0f, (int)e - 128);
}

void pp_mxpanel_pack(const void *data, int64_t k, int64_t p0, int64_t p1, uint8_t *out) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    const size_t block_bytes = ggml_type_size(GGML_TYPE_MXFP4), row_bytes = (size_t)nb * block_bytes;
    for (int64_t pi = p0; pi < p1; pi++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + ((size_t)pi * nb + b) * PP_PANEL_MX_BLOCK_BYTES;
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                const uint8_t *blk = (const uint8_t *)data + (size_t)(pi * PP_PANEL_ROWS + r) * row_bytes +
                                     (size_t)b * block_bytes;
                dst[r] = blk[0];
                for (int j = 0; j < 4; j++) memcpy(dst + PP_PANEL_ROWS + 32 * j + 4 * r, blk + 1 + 4 * j, 4);
            }
        }
}

/* Row r's code for value t of a stored block. */
static int stored_code(const uint8_t *blk, int r, int t) {
    const int i = 32 * (t / 4) + 4 * r + t % 4;
    const uint8_t byte = blk[PP_PANEL_ROWS + i % 128];
    return i < 128 ? byte & 0x0F : byte >> 4;
}

void pp_mxpanel_row(const pp_q8_panels *w, int64_t row, float *out) {
    const int64_t nb = w->k / PP_PANEL_BLOCK;
    const int r = (int)(row % PP_PANEL_ROWS);
    const uint8_t *panel = w->data + (size_t)(row / PP_PANEL_ROWS) * nb * PP_PANEL_MX_BLOCK_BYTES;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + (size_t)b * PP_PANEL_MX_BLOCK_BYTES;
        const float d = pp_mx_half_scale(blk[r]);
        /* GGML's dequantization: the doubled code's int8 times the halved scale */
        for (int t = 0; t < PP_PANEL_BLOCK; t++)
            out[b * PP_PANEL_BLOCK + t] = (float)pp_mx_doubled_value[stored_code(blk, r, t)] * d;
    }
}

/* Signed doubled codes times the column's bytes need no bias (the SIMD
 * kernels' is for unsigned bytes): the same integer dot products. */
void pp_mxpanel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                            size_t col_stride, int64_t n, float *out, size_t ldo) {
    const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;
    float half_scale[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_ROWS];
    for (int64_t pi = p0; pi < p1; pi++) {
        const uint8_t *panel = w->data + (size_t)pi * nb * PP_PANEL_MX_BLOCK_BYTES;
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < PP_PANEL_ROWS; r++)
                half_scale[b * PP_PANEL_ROWS + r] = pp_mx_half_scale(panel[(size_t)b * PP_PANEL_MX_BLOCK_BYTES + r]);
        for (int64_t c = 0; c < n; c++) {
            const uint8_t *col = cols + (size_t)c * col_stride;
            const int8_t *q = (const int8_t *)col;
            const float *scale = PP_COL_SCALE(col, k);
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = panel + (size_t)b * PP_PANEL_MX_BLOCK_BYTES;
                    int32_t dot = 0;
                    for (int t = 0; t < PP_PANEL_BLOCK; t++)
                        dot += pp_mx_doubled_value[stored_code(blk, r, t)] * q[b * PP_PANEL_BLOCK + t];
                    acc += (float)dot * (half_scale[b * PP_PANEL_ROWS + r] * scale[b]);
                }
                out[(size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS + r] = acc;
            }
        }
    }
}
