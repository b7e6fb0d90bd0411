/* K panels (panel_formats.h): Q4_K, Q5_K and Q6_K weights in 8-row panels for the
 * panel GEMM. Packing, the portable widening and kernel; the SIMD ones are
 * in kquant_panel_kernels.c.
 *
 * Stored layout, per panel and 256-value superblock (8 rows):
 *   Q4_K (1184 bytes): d[8] and dmin[8] (fp16), sc[8 blocks][8 rows] and
 *     m[8][8] (the 6-bit scales and mins as bytes), then per 32-value block
 *     128 bytes of nibbles: code i of the block's compute layout (i = 32j +
 *     4r + e: group j, row r) in byte i % 128, the high nibble for i >= 128;
 *   Q5_K (1440 bytes): as Q4_K, and after each block's nibbles its fifth
 *     bits (32 bytes: code i's in byte i % 32, bit i / 32);
 *   Q6_K (1680 bytes): d[8] (fp16), sc[16 half-blocks][8 rows] (int8), then
 *     per block the low nibbles as Q4_K (128 bytes) and the high two bits
 *     (64 bytes: code i's in byte i % 64, bits 2 * (i / 64)).
 * Reading the superblock's scales in order and each block's codes as whole
 * vectors is what the kernels want; the bytes are GGML's, moved. */
#include "panels/panel_formats.h"

#include <string.h>

/* One GGML row superblock as unsigned codes and integer sub-block scales. */
typedef struct kblock {
    uint8_t     code[PP_PANEL_KBLOCK];
    uint8_t     sc[16];       /* Q4_K, Q5_K: 8 scales; Q6_K: 16 (int8 bits) */
    uint8_t     m[8];         /* Q4_K, Q5_K: 8 mins */
    ggml_fp16_t d, dmin;
} kblock;

/* The 6-bit scales and mins GGML's block_q4_K and block_q5_K share (12
 * bytes at s). */
static void decode_k_scales(const uint8_t *s, kblock *out) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            out->sc[j] = s[j] & 63;
            out->m[j] = s[j + 4] & 63;
        } else {
            out->sc[j] = (uint8_t)((s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4);
            out->m[j] = (uint8_t)((s[j + 4] >> 4) | (s[j] >> 6) << 4);
        }
    }
}

/* GGML's block_q4_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins,
 * 128 bytes of nibbles (64 values per 32 bytes: low nibbles first). */
static void decode_q4_k(const uint8_t *src, kblock *out) {
    memcpy(&out->d, src, 2);
    memcpy(&out->dmin, src + 2, 2);
    decode_k_scales(src + 4, out);
    const uint8_t *qs = src + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            out->code[64 * c + l] = qs[32 * c + l] & 0x0F;
            out->code[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
}

/* GGML's block_q5_K: d, dmin, the scales as Q4_K, qh[32] (value l of
 * 32-value block j has its fifth bit in bit j of qh[l]), then the nibbles
 * as Q4_K's. */
static void decode_q5_k(const uint8_t *src, kblock *out) {
    memcpy(&out->d, src, 2);
    memcpy(&out->dmin, src + 2, 2);
    decode_k_scales(src + 4, out);
    const uint8_t *qh = src + 16, *qs = src + 48;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            out->code[64 * c + l] = (uint8_t)((qs[32 * c + l] & 0x0F) | ((qh[l] >> (2 * c)) & 1) << 4);
            out->code[64 * c + 32 + l] = (uint8_t)((qs[32 * c + l] >> 4) | ((qh[l] >> (2 * c + 1)) & 1) << 4);
        }
}

/* GGML's block_q6_K: ql[128] (low nibbles), qh[64] (high bit pairs),
 * int8 scales[16] (one per 16 values), d (fp16). */
static void decode_q6_k(const uint8_t *src, kblock *out) {
    memcpy(out->sc, src + 192, 16);
    memcpy(&out->d, src + 208, 2);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = src + 64 * h, *qh = src + 128 + 32 * h;
        uint8_t *v = out->code + 128 * h;
        for (int l = 0; l < 32; l++) {
            v[l] = (uint8_t)((ql[l] & 0x0F) | (qh[l] & 3) << 4);
            v[l + 32] = (uint8_t)((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4);
            v[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
            v[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
    }
}

size_t pp_kpanel_superblock_bytes(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K ? PP_PANEL_Q4K_BYTES
         : type == GGML_TYPE_Q5_K ? PP_PANEL_Q5K_BYTES : PP_PANEL_Q6K_BYTES;
}

/* Q4_K and Q5_K: scales and mins per 32 values; Q6_K: scales per 16. */
static int has_mins(enum ggml_type type) {
    return type != GGML_TYPE_Q6_K;
}



/* Place row r's decoded superblock into a panel superblock. */
static void place(enum ggml_type type, const kblock *kb, int r, uint8_t *dst) {
    memcpy(dst + 2 * r, &kb->d, 2);
    if (has_mins(type)) {
        memcpy(dst + 16 + 2 * r, &kb->dmin, 2);
        for (int b = 0; b < 8; b++) {
            dst[32 + 8 * b + r] = kb->sc[b];
            dst[96 + 8 * b + r] = kb->m[b];
        }
    } else {
        for (int h = 0; h < 16; h++) dst[16 + 8 * h + r] = kb->sc[h];
    }
    /* Code t of the block is panel value i = 32 (t / 4) + 4r + t % 4: codes t
     * and t + 16 (t < 16) share nibble byte i % 128 (low, high); Q5_K's fifth
     * bit of code t is bit t / 4 of byte 128 + 4r + t % 4; Q6_K's high pair is
     * bits 2 (t / 8) of byte 128 + 32 (t / 4 % 2) + 4r + t % 4. Each byte
     * belongs to one row: written whole. */
    const size_t hb = pp_kpanel_header_bytes(type), cb = pp_kpanel_block_bytes(type);
    for (int b = 0; b < 8; b++) {
        uint8_t *blk = dst + hb + (size_t)b * cb;
        const uint8_t *code = kb->code + 32 * b;
        for (int t = 0; t < 16; t++)
            blk[32 * (t / 4) + 4 * r + t % 4] = (uint8_t)((code[t] & 0x0F) | (code[t + 16] & 0x0F) << 4);
        if (type == GGML_TYPE_Q5_K)
            for (int e = 0; e < 4; e++) {
                int bits = 0;
                for (int j = 0; j < 8; j++) bits |= ((code[4 * j + e] >> 4) & 1) << j;
                blk[128 + 4 * r + e] = (uint8_t)bits;
            }
        if (type == GGML_TYPE_Q6_K)
            for (int half = 0; half < 2; half++)
                for (int e = 0; e < 4; e++) {
                    int bits = 0;
                    for (int m = 0; m < 4; m++) bits |= ((code[4 * (half + 2 * m) + e] >> 4) & 3) << (2 * m);
                    blk[128 + 32 * half + 4 * r + e] = (uint8_t)bits;
                }
    }
}

void pp_kpanel_pack(const void *data, enum ggml_type type, int64_t k, int64_t p0, int64_t p1, uint8_t *out) {
    const int64_t nsb = k / PP_PANEL_KBLOCK;
    const size_t row_bytes = (size_t)nsb * ggml_type_size(type), sbb = pp_kpanel_superblock_bytes(type);
    kblock kb;
    for (int64_t pi = p0; pi < p1; pi++)
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *dst = out + ((size_t)pi * nsb + s) * sbb;
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                const uint8_t *src = (const uint8_t *)data + (size_t)(pi * PP_PANEL_ROWS + r) * row_bytes +
                                     (size_t)s * ggml_type_size(type);
                if (type == GGML_TYPE_Q4_K) decode_q4_k(src, &kb);
                else if (type == GGML_TYPE_Q5_K) decode_q5_k(src, &kb);
                else decode_q6_k(src, &kb);
                place(type, &kb, r, dst);
            }
        }
}

const uint8_t *pp_kpanel_superblock(const pp_q8_panels *w, int64_t pi, int64_t s) {
    const int64_t nsb = w->k / PP_PANEL_KBLOCK;
    return w->data + ((size_t)pi * nsb + s) * pp_kpanel_superblock_bytes(w->type);
}

/* The products GGML's dequantization forms (d * sc, dmin * m, in f32):
 * exact, and the values the kernels scale by. */
void pp_kpanel_widen_scales(const pp_q8_panels *w, int64_t pi, pp_kpanel *out) {
    const int64_t nsb = w->k / PP_PANEL_KBLOCK;
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = pp_kpanel_superblock(w, pi, s);
        ggml_fp16_t h[16];
        memcpy(h, sb, has_mins(w->type) ? 32 : 16);
        for (int r = 0; r < PP_PANEL_ROWS; r++) {
            const float d = ggml_fp16_to_fp32(h[r]);
            if (has_mins(w->type)) {
                const float dmin = ggml_fp16_to_fp32(h[8 + r]);
                for (int b = 0; b < 8; b++) {
                    out->scale[(8 * s + b) * 8 + r] = d * (float)sb[32 + 8 * b + r];
                    out->min[(8 * s + b) * 8 + r] = dmin * (float)sb[96 + 8 * b + r];
                }
            } else {
                for (int q = 0; q < 16; q++) out->scale[(16 * s + q) * 8 + r] = d * (float)(int8_t)sb[16 + 8 * q + r];
            }
        }
    }
}

void pp_kpanel_widen_codes(const pp_q8_panels *w, int64_t pi, uint8_t *codes) {
    const int64_t nsb = w->k / PP_PANEL_KBLOCK;
    const size_t hb = pp_kpanel_header_bytes(w->type), cb = pp_kpanel_block_bytes(w->type);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = pp_kpanel_superblock(w, pi, s);
        for (int b = 0; b < 8; b++) {
            const uint8_t *blk = sb + hb + (size_t)b * cb;
            uint8_t *dst = codes + (size_t)(8 * s + b) * 256;
            for (int i = 0; i < 256; i++) {
                int u = i < 128 ? blk[i] & 0x0F : blk[i - 128] >> 4;
                if (w->type == GGML_TYPE_Q5_K) u |= ((blk[128 + i % 32] >> (i / 32)) & 1) << 4;
                if (w->type == GGML_TYPE_Q6_K) u |= ((blk[128 + i % 64] >> (2 * (i / 64))) & 3) << 4;
                dst[i] = (uint8_t)u;
            }
        }
    }
}

/* Row r's value t of block b, as GGML's dequantization computes it. */
static float kpanel_value(enum ggml_type type, const pp_kpanel *p, int64_t b, int r, int t) {
    const int u = p->codes[(size_t)b * 256 + 32 * (t / 4) + 4 * r + t % 4];
    if (has_mins(type)) return p->scale[b * 8 + r] * (float)u - p->min[b * 8 + r];
    return p->scale[(2 * b + t / 16) * 8 + r] * (float)(u - 32);
}

/* One widened panel per thread, shared by every K kernel: too large for a
 * worker thread's stack to hold comfortably (192 KiB). */
static _Thread_local struct {
    _Alignas(64) uint8_t codes[PP_KPANEL_CODE_BYTES];
    _Alignas(64) float scale[PP_KPANEL_SCALES];
    _Alignas(64) float min[PP_KPANEL_SCALES];
} scratch;

pp_kpanel pp_kpanel_scratch(void) {
    return (pp_kpanel){scratch.codes, scratch.scale, scratch.min};
}

void pp_kpanel_row(const pp_q8_panels *w, int64_t row, float *out) {
    pp_kpanel p = pp_kpanel_scratch();
    pp_kpanel_widen_scales(w, row / PP_PANEL_ROWS, &p);
    pp_kpanel_widen_codes(w, row / PP_PANEL_ROWS, p.codes);
    for (int64_t b = 0; b < w->k / PP_PANEL_BLOCK; b++)
        for (int t = 0; t < PP_PANEL_BLOCK; t++)
            out[b * PP_PANEL_BLOCK + t] = kpanel_value(w->type, &p, b, (int)(row % PP_PANEL_ROWS), t);
}

void pp_kpanel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                           size_t col_stride, int64_t n, float *out, size_t ldo) {
    pp_kpanel p = pp_kpanel_scratch();
    uint8_t *codes = p.codes;
    const float *scale = p.scale, *min = p.min;
    const int64_t k = w->k, nb = k / PP_PANEL_BLOCK;
    for (int64_t pi = p0; pi < p1; pi++) {
        pp_kpanel_widen_scales(w, pi, &p);
        pp_kpanel_widen_codes(w, pi, codes);
        for (int64_t c = 0; c < n; c++) {
            const uint8_t *col = cols + (size_t)c * col_stride;
            const int8_t *q = (const int8_t *)col;
            const float *cs = PP_COL_SCALE(col, k), *ssum = PP_COL_SSUM(col, k);
            const int32_t *off16 = PP_COL_OFFSET16(col, k);
            for (int r = 0; r < PP_PANEL_ROWS; r++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = codes + (size_t)b * 256;
                    int32_t dot[2] = {0, 0};
                    for (int t = 0; t < PP_PANEL_BLOCK; t++)
                        dot[t / 16] += (int32_t)blk[32 * (t / 4) + 4 * r + t % 4] * q[b * PP_PANEL_BLOCK + t];
                    if (has_mins(w->type)) {
                        acc += (float)(dot[0] + dot[1]) * (scale[b * 8 + r] * cs[b]);
                        acc -= min[b * 8 + r] * ssum[b];
                    } else {
                        for (int h = 0; h < 2; h++)
                            acc += (float)(dot[h] + off16[2 * b + h]) * (scale[(2 * b + h) * 8 + r] * cs[b]);
                    }
                }
                out[(size_t)c * ldo + (size_t)pi * PP_PANEL_ROWS + r] = acc;
            }
        }
    }
}
