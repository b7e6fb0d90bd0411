/* Q8 panels (panel_formats.h): Q8_0 weights in the compute layout, Q5_0 and
 * Q4_0 ones in their own bytes widened a panel at a time; packing, a row
 * read back, the portable kernel, and the activation columns' quantization
 * that every quantized format's kernels read. The VNNI kernels are in
 * q8_panel_kernels.c. */
#include "panels/panel_formats.h"

#include <math.h>
#include <string.h>

/* One row's 32-value block into its panel-block (row r), as whole 4-byte
 * groups: panel value i = 32j + 4r + e is the row's value t = 4j + e.
 * Q8_0: code q + 128 in byte i. Q4_0 and Q5_0: byte i % 128 holds value i's
 * nibble (low for i < 128, high above), which is exactly GGML's nibble byte
 * t % 16 of the row (value t low, t + 16 high); Q5_0's fifth bits go to bit
 * i of bytes 144... */
static void pack_block_row(enum ggml_type type, const uint8_t *blk, int r, uint8_t *dst) {
    memcpy(dst + 2 * r, blk, 2);   /* every type starts with the fp16 scale */
    if (type == GGML_TYPE_Q8_0) {
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++) dst[16 + 32 * j + 4 * r + e] = (uint8_t)(blk[2 + 4 * j + e] ^ 0x80);
        return;
    }
    /* block_q4_0: scale, 16 nibble bytes; block_q5_0: scale, 32 fifth bits, 16 nibble bytes */
    const uint8_t *nibbles = blk + (type == GGML_TYPE_Q5_0 ? 6 : 2);
    for (int j = 0; j < 4; j++) memcpy(dst + 16 + 32 * j + 4 * r, nibbles + 4 * j, 4);
    if (type != GGML_TYPE_Q5_0) return;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    for (int t = 0; t < PP_PANEL_BLOCK; t++)
        if ((qh >> t) & 1) {
            const int i = 32 * (t / 4) + 4 * r + t % 4;
            dst[144 + i / 8] |= (uint8_t)(1u << (i % 8));
        }
}

void pp_q8panel_pack(const void *data, enum ggml_type type, int64_t k, int64_t p0, int64_t p1, uint8_t *out) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    const size_t pbb = pp_q8panel_block_bytes(type);
    /* Q5_0's fifth bits are ORed in; everything else is written whole */
    if (type == GGML_TYPE_Q5_0) memset(out + (size_t)p0 * nb * pbb, 0, (size_t)(p1 - p0) * nb * pbb);
    const uint8_t *src = data;
    const size_t row_bytes = (size_t)nb * ggml_type_size(type);
    for (int64_t pi = p0; pi < p1; pi++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + ((size_t)pi * nb + b) * pbb;
            for (int r = 0; r < PP_PANEL_ROWS; r++)
                pack_block_row(type, src + (size_t)(pi * PP_PANEL_ROWS + r) * row_bytes + (size_t)b * ggml_type_size(type),
                               r, dst);
        }
    }
}

/* A Q5_0 or Q4_0 panel widened into the compute layout (portable). */
static void widen_scalar(enum ggml_type type, const uint8_t *panel, int64_t nb, uint8_t *out) {
    const size_t pbb = pp_q8panel_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + (size_t)b * pbb;
        uint8_t *dst = out + (size_t)b * PP_PANEL_BLOCK_BYTES;
        memcpy(dst, src, 16);
        for (int i = 0; i < 256; i++) {
            const int lo = i < 128 ? src[16 + i] & 0x0F : src[16 + i - 128] >> 4;
            if (type == GGML_TYPE_Q4_0) {
                dst[16 + i] = (uint8_t)(lo + 120);   /* q - 8 + 128 */
                continue;
            }
            const int hi = (src[144 + i / 8] >> (i % 8)) & 1;
            dst[16 + i] = (uint8_t)((lo | hi << 4) + 112);   /* q - 16 + 128 */
        }
    }
}

/* Panel pi in the compute layout: in place for Q8_0, else widened into tmp. */
static const uint8_t *compute_panel(const pp_q8_panels *w, int64_t pi, uint8_t *tmp) {
    const int64_t nb = w->k / PP_PANEL_BLOCK;
    if (w->type == GGML_TYPE_Q8_0) return w->data + (size_t)pi * nb * PP_PANEL_BLOCK_BYTES;
    widen_scalar(w->type, w->data + (size_t)pi * nb * pp_q8panel_block_bytes(w->type), nb, tmp);
    return tmp;
}

void pp_q8panel_row(const pp_q8_panels *p, int64_t row, float *out) {
    const int64_t nb = p->k / PP_PANEL_BLOCK;
    const int r = (int)(row % PP_PANEL_ROWS);
    uint8_t tmp[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_BLOCK_BYTES];
    const uint8_t *panel = compute_panel(p, row / PP_PANEL_ROWS, tmp);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + (size_t)b * PP_PANEL_BLOCK_BYTES;
        ggml_fp16_t h;
        memcpy(&h, blk + 2 * r, 2);
        const float d = ggml_fp16_to_fp32(h);
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++)
                out[b * PP_PANEL_BLOCK + 4 * j + e] = d * (float)((int)blk[16 + 32 * j + 4 * r + e] - 128);
    }
}

/* Q8_0 quantization of one column as GGML's x86 code does it (scale amax /
 * 127 kept as fp16, values rounded to nearest even), plus each block's
 * sums (see pp_panel_column_bytes). */
void pp_panel_quantize_column(const float *x, int64_t k, uint8_t *col) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    int8_t *q = (int8_t *)col;
    float *scale = (float *)(col + k);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * PP_PANEL_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < PP_PANEL_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        /* the reciprocal as GGML's x86 quantizer takes it, so the bytes match its */
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t half[2] = {0, 0};
        for (int i = 0; i < PP_PANEL_BLOCK; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            q[b * PP_PANEL_BLOCK + i] = (int8_t)v;
            half[i / 16] += v;
        }
        scale[b] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(d));
        pp_panel_column_sums(col, k, b, scale[b], half[0], half[1]);
    }
}

void pp_panel_column_sums(uint8_t *col, int64_t k, int64_t b, float scale, int32_t half0, int32_t half1) {
    const int64_t nb = k / PP_PANEL_BLOCK;
    const int32_t offset = -128 * (half0 + half1), off16[2] = {-32 * half0, -32 * half1};
    const float ssum = scale * (float)(half0 + half1);
    memcpy(col + k + 4 * nb + 4 * b, &offset, 4);
    memcpy(col + k + 8 * nb + 4 * b, &ssum, 4);
    memcpy(col + k + 12 * nb + 8 * b, off16, 8);
}

void pp_panel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                          size_t col_stride, int64_t n, float *out, size_t ldo) {
    const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;
    uint8_t tmp[PP_PANEL_MAX_K / PP_PANEL_BLOCK * PP_PANEL_BLOCK_BYTES];
    for (int64_t pi = p0; pi < p1; pi++) {
        const uint8_t *panel = compute_panel(w, pi, tmp);
        for (int64_t c = 0; c < n; c++) {
            const uint8_t *col = cols + (size_t)c * col_stride;
            const int8_t *q = (const int8_t *)col;
            const float *scale = (const float *)(col + k);
            const int32_t *offset = (const int32_t *)(col + k + 4 * nb);
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = panel + (size_t)b * PP_PANEL_BLOCK_BYTES;
                    int32_t dot = offset[b];
                    for (int j = 0; j < 8; j++)
                        for (int e = 0; e < 4; e++)
                            dot += (int32_t)blk[16 + 32 * j + 4 * r + e] * q[b * PP_PANEL_BLOCK + 4 * j + e];
                    ggml_fp16_t h;
                    memcpy(&h, blk + 2 * r, 2);
                    acc += (float)dot * (ggml_fp16_to_fp32(h) * scale[b]);
                }
                out[(size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS + r] = acc;
            }
        }
    }
}

