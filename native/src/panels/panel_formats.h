/* What each panel format gives the dispatcher (panels.c): its stored
 * layout, packing and reading a row back, and its kernels, portable and per
 * instruction set; and the layout of the activation columns the quantized
 * formats' kernels read. The formats are q8_panels.c (Q8_0, Q5_0, Q4_0),
 * kquant_panels.c (Q4_K, Q5_K, Q6_K), mxfp4_panels.c (MXFP4) and
 * float_panels.c (F16, BF16), each with its kernels beside it; none calls
 * the dispatcher or another format. */
#ifndef PP_PANEL_FORMATS_H
#define PP_PANEL_FORMATS_H

#include "panels/panels.h"
#include "common/pp_internal.h"

#define PP_PANEL_BLOCK 32
#define PP_PANEL_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK + 2))      /* 272: Q8 panels */
#define PP_PANEL_Q5_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK / 2 + 6)) /* 176: Q5_0 panels */
#define PP_PANEL_Q4_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK / 2 + 2)) /* 144: Q4_0 panels */
/* Longest Q5_0, Q4_0 or MXFP4 row: one widened panel (k / 32 x 272 or 288 bytes) lives on the stack. */
#define PP_PANEL_MAX_K 8192
/* K panels: 256-value superblocks; a widened panel (k / 32 x 256 code bytes
 * plus its scales) of up to this many values lives on the stack. */
#define PP_PANEL_KBLOCK 256
#define PP_PANEL_K_MAX_K 16384
#define PP_PANEL_Q4K_BYTES (PP_PANEL_ROWS * 148)   /* 1184 per superblock: 8 x 144 + 32 (scales unpacked) */
#define PP_PANEL_Q5K_BYTES (PP_PANEL_ROWS * 180)   /* 1440 per superblock: 8 x 176 + 32 (scales unpacked) */
#define PP_PANEL_Q6K_BYTES (PP_PANEL_ROWS * 210)   /* 1680 per superblock: 8 x 210 */

/* ---- the activation columns ---------------------------------------------- */

/* The column layout the quantize op writes and the kernels read: k signed
 * bytes, then per 32-value block b (nb = k / 32 of each): float scale[b],
 * int32 offset[b] (-128 times the block's byte sum, taking Q8 panels' +128
 * back out), float scaled_sum[b] (scale times byte sum, for Q4_K's mins,
 * exact in f32), then per 16 values int32 offset16[2b], [2b + 1] (-32
 * times the half-block's byte sum, Q6_K's -32). */
static inline size_t pp_panel_column_bytes(int64_t k) {
    return (size_t)k + (size_t)(k / PP_PANEL_BLOCK) * 20;
}
#define PP_COL_SCALE(col, k) ((const float *)((col) + (k)))
#define PP_COL_OFFSET(col, k) ((const int32_t *)((col) + (k) + 4 * ((k) / PP_PANEL_BLOCK)))
#define PP_COL_SSUM(col, k) ((const float *)((col) + (k) + 8 * ((k) / PP_PANEL_BLOCK)))
#define PP_COL_OFFSET16(col, k) ((const int32_t *)((col) + (k) + 12 * ((k) / PP_PANEL_BLOCK)))

/* q8_panels.c: one column into that layout, portable (and on AVX2 in
 * q8_panel_kernels.c: the same bytes); block b's sums into a column (both
 * quantizers): the offset, scaled sum and half-block offsets from the
 * halves' byte sums. */
pp_panel_quantizer pp_panel_quantize_column;
void pp_panel_column_sums(uint8_t *col, int64_t k, int64_t b, float scale, int32_t half0, int32_t half1);

/* ---- Q8 panels: Q8_0, Q5_0 and Q4_0 (q8_panels.c, q8_panel_kernels.c) ----- */

/* Bytes of one panel-block (8 rows x 32 values) as stored. */
static inline size_t pp_q8panel_block_bytes(enum ggml_type type) {
    return type == GGML_TYPE_Q5_0 ? PP_PANEL_Q5_BLOCK_BYTES
         : type == GGML_TYPE_Q4_0 ? PP_PANEL_Q4_BLOCK_BYTES : PP_PANEL_BLOCK_BYTES;
}
/* Pack a GGML [k, n_rows] weight's panels [p0, p1) into out; one row as f32. */
PP_HIDDEN void pp_q8panel_pack(const void *data, enum ggml_type type, int64_t k, int64_t p0, int64_t p1,
                               uint8_t *out);
PP_HIDDEN void pp_q8panel_row(const pp_q8_panels *w, int64_t row, float *out);
pp_panel_gemm_kernel pp_panel_gemm_scalar;

/* ---- K panels: Q4_K, Q5_K and Q6_K (kquant_panels.c, kquant_panel_kernels.c) */

/* A K panel widened for the kernels: nb blocks of 256 code bytes (as Q8
 * panels' groups, unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), and f32
 * scales of 8 rows: Q4_K and Q5_K scale[b][8] = d * sc and min[b][8] =
 * dmin * m per 32-value block; Q6_K scale[2b + h][8] = d * sc per 16
 * values, min unused. */
typedef struct pp_kpanel {
    uint8_t *codes;
    float   *scale;
    float   *min;
} pp_kpanel;
/* Stack room for one widened K panel of up to PP_PANEL_K_MAX_K values. */
#define PP_KPANEL_CODE_BYTES (PP_PANEL_K_MAX_K / PP_PANEL_BLOCK * 256)
#define PP_KPANEL_SCALES (PP_PANEL_K_MAX_K / 16 * PP_PANEL_ROWS)
/* K panels' storage: bytes per panel superblock; pack a GGML [k, n_rows]
 * weight's panels [p0, p1) into out (n_rows / 8 * k / 256 superblocks); the
 * address of panel pi's superblock s; one row as f32 (tied embeddings). */
size_t pp_kpanel_superblock_bytes(enum ggml_type type);
/* Within a panel superblock: the scales' bytes, then each 32-value block's
 * code bytes (nibbles, then Q5_K's fifth bits or Q6_K's high bit pairs). */
static inline size_t pp_kpanel_header_bytes(enum ggml_type type) {
    return type == GGML_TYPE_Q6_K ? 144 : 160;
}
static inline size_t pp_kpanel_block_bytes(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K ? 128 : type == GGML_TYPE_Q5_K ? 160 : 192;
}
void pp_kpanel_pack(const void *data, enum ggml_type type, int64_t k, int64_t p0, int64_t p1, uint8_t *out);
const uint8_t *pp_kpanel_superblock(const pp_q8_panels *w, int64_t pi, int64_t s);
void pp_kpanel_row(const pp_q8_panels *w, int64_t row, float *out);
/* This thread's room for one widened panel. */
pp_kpanel pp_kpanel_scratch(void);
/* Widen panel pi's scales (portable: a thirty-second of the work). */
void pp_kpanel_widen_scales(const pp_q8_panels *w, int64_t pi, pp_kpanel *out);
/* Widen panel pi's codes: portable, and on AVX2 (the same bytes). */
void pp_kpanel_widen_codes(const pp_q8_panels *w, int64_t pi, uint8_t *codes);
pp_panel_gemm_kernel pp_kpanel_gemm_scalar;

/* ---- MXFP4 panels (mxfp4_panels.c, mxfp4_panel_kernels.c) ----------------- */

/* Stored: per panel and 32-value block, the 8 rows' E8M0 exponents (8
 * bytes), then the 8 rows' E2M1 codes as Q4_0 panels hold their nibbles
 * (128 bytes): 17 bytes per row-block, the file's. Widened (many columns):
 * the rows' f32 scales (32 bytes), then 256 biased code bytes in the
 * compute layout's [group][row][4] order. */
#define PP_PANEL_MX_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK / 2 + 1))   /* 136 */
#define PP_PANEL_MX_WIDE_BYTES (PP_PANEL_ROWS * 4 + PP_PANEL_ROWS * PP_PANEL_BLOCK)   /* 288 */
/* The kernels multiply unsigned bytes: E2M1 code c as twice its value plus
 * this bias (0..24; 2 x 24 x 127 cannot saturate AVX2's 16-bit pair sums),
 * the bias taken back out through the column's byte sum. Twice the value
 * makes every code an integer; the scale halves to 2^(e - 128). */
#define PP_MX_CODE_BIAS 12
extern const int8_t pp_mx_doubled_value[16];
/* 2^(e - 128), what a doubled code is multiplied by (exact, denormals too). */
float pp_mx_half_scale(uint8_t e);
/* Pack panels [p0, p1) of a GGML [k, n_rows] MXFP4 weight into out; one row
 * as f32 (GGML's dequantized values, bit for bit). */
void pp_mxpanel_pack(const void *data, int64_t k, int64_t p0, int64_t p1, uint8_t *out);
void pp_mxpanel_row(const pp_q8_panels *w, int64_t row, float *out);
pp_panel_gemm_kernel pp_mxpanel_gemm_scalar;

/* ---- float panels: F16 and BF16 (float_panels.c) -------------------------- */

/* Pack panels [p0, p1) of a GGML [k, n_rows] F16 or BF16 weight into out
 * (n_rows x k 16-bit values); one row as f32. Their kernels read f32
 * columns (col_stride bytes apart). */
void pp_fpanel_pack(const void *data, int64_t k, int64_t p0, int64_t p1, uint8_t *out);
void pp_fpanel_row(const pp_q8_panels *w, int64_t row, float *out);
pp_panel_gemm_kernel pp_fpanel_gemm_scalar;
/* Whether BF16 panels run on BF16 dot products here (AVX-512 BF16;
 * PYLLAMA_PAGED_BF16_DOT=0 keeps the FMA kernel). */
int pp_fpanel_bf16_dot_runs_here(void);

/* ---- the kernels per instruction set -------------------------------------- */

#if defined(__x86_64__)
pp_panel_quantizer pp_panel_quantize_column_avx2;
/* Q8 panels: AVX-512 VNNI and AVX-VNNI (no AVX2 kernel: see pp_q8_panels_fit). */
pp_panel_gemm_kernel pp_panel_gemm_avx512vnni, pp_panel_gemm_avxvnni;
/* K panels: the widening on AVX2 and the kernels on each. */
void pp_kpanel_widen_codes_avx2(const pp_q8_panels *w, int64_t pi, uint8_t *codes);
void pp_kpanel_widen_scales_avx2(const pp_q8_panels *w, int64_t pi, pp_kpanel *out);
pp_panel_gemm_kernel pp_kpanel_gemm_avx512vnni, pp_kpanel_gemm_avxvnni, pp_kpanel_gemm_avx2;
/* MXFP4 panels: the codes through a byte shuffle, on each. */
pp_panel_gemm_kernel pp_mxpanel_gemm_avx512vnni, pp_mxpanel_gemm_avxvnni, pp_mxpanel_gemm_avx2;
/* Float panels: AVX-512F (run with the AVX-512 VNNI kernel) and AVX2 + FMA
 * + F16C; BF16 panels with the AVX-512 kernel: AVX-512 BF16 dot products on
 * the activations rounded to BF16, as GGML's BF16 products round them, where
 * the CPU has them; the FMA kernel otherwise. */
pp_panel_gemm_kernel pp_fpanel_gemm_avx512vnni, pp_fpanel_gemm_avx2, pp_fpanel_gemm_bf16_avx512vnni;
#endif

#endif
