/* Weights in row panels for our VNNI integer GEMM (the "panel GEMM").
 *
 * On small models the output head is most of a step's multiply-adds
 * (Gemma 3 270M: 168M of its 268M per token) and the Q5_0 projections most
 * of the rest. GGML multiplies such weights by Q8_0 activations with
 * signed-by-signed byte products, two sign fix-ups and a scale per row,
 * column and 32-value block, re-reading each weight block for every few
 * columns. Here a weight's rows are interleaved eight at a time so one VNNI
 * dot-product instruction multiplies eight rows by four bytes of one
 * activation column: the eight lanes are eight output rows, the rows' block
 * scales are one vector load, and the weight bytes are unsigned (value +
 * 128) with the offset taken back out through the activation block's sum.
 *
 * Compute layout ("Q8 panels"): panel p holds rows 8p..8p+7; for each block
 * b of 32 values, 272 bytes: the 8 rows' fp16 scales (16 bytes), then groups
 * j = 0..7 of [8 rows][4 bytes] (values 4j..4j+3 of the block, as value +
 * 128). 272 bytes are the 8 rows' Q8_0 blocks: packing Q8_0 changes the
 * layout, not the size, and is exact.
 *
 * Q5_0 weights keep their 22 bytes per row-block (176 per panel-block): the
 * scales (16 bytes), the low nibbles of the same 256 values in the same
 * order (128 bytes: value i in byte i % 128, high nibble for i >= 128) and
 * their fifth bits (32 bytes, bit i). A kernel widens one panel at a time
 * into the compute layout (value - 16 + 128), on the stack. Q4_0 weights
 * likewise keep their 18 bytes per row-block (144 per panel-block: the
 * scales and the nibbles, no fifth bits), widened to value - 8 + 128.
 *
 * K-quant weights (Q4_K and Q6_K, what Q4_K_M files hold; Q5_K, with Q6_K
 * what Q5_K_M files hold) keep their bytes too, in "K panels" of
 * superblocks (8 rows x 256 values), see kquant_panels.c: a kernel widens
 * one panel into unsigned codes in the same [group][row][4 bytes] order
 * plus f32 sub-block scales (d * sc, and dmin * m for Q4_K and Q5_K), and
 * takes the offsets (the mins; Q6_K's -32) back out through the column's
 * block sums.
 *
 * F16 and BF16 weights ("float panels", float_panels.c) keep their 16-bit
 * values in [quad of 4 values][8 rows][4] order and multiply the f32
 * activations themselves: no quantize op, f32 FMAs. */
#ifndef PP_Q8_PANELS_H
#define PP_Q8_PANELS_H

#include "pyllama_paged.h"
#include "ggml.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>

#define PP_PANEL_ROWS 8
#define PP_PANEL_BLOCK 32
#define PP_PANEL_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK + 2))      /* 272: Q8 panels */
#define PP_PANEL_Q5_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK / 2 + 6)) /* 176: Q5_0 panels */
#define PP_PANEL_Q4_BLOCK_BYTES (PP_PANEL_ROWS * (PP_PANEL_BLOCK / 2 + 2)) /* 144: Q4_0 panels */
/* Longest Q5_0 or Q4_0 row: one widened panel (k / 32 x 272 bytes) lives on the stack. */
#define PP_PANEL_MAX_K 8192
/* K panels: 256-value superblocks; a widened panel (k / 32 x 256 code bytes
 * plus its scales) of up to this many values lives on the stack. */
#define PP_PANEL_KBLOCK 256
#define PP_PANEL_K_MAX_K 16384
#define PP_PANEL_Q4K_BYTES (PP_PANEL_ROWS * 148)   /* 1184 per superblock: 8 x 144 + 32 (scales unpacked) */
#define PP_PANEL_Q5K_BYTES (PP_PANEL_ROWS * 180)   /* 1440 per superblock: 8 x 176 + 32 (scales unpacked) */
#define PP_PANEL_Q6K_BYTES (PP_PANEL_ROWS * 210)   /* 1680 per superblock: 8 x 210 */

typedef struct pp_q8_panels {
    enum ggml_type type;   /* storage: GGML_TYPE_Q8_0 (compute layout), Q5_0, Q4_0, Q4_K, Q5_K, Q6_K, F16 or BF16 */
    int64_t  n_rows;       /* output rows, a multiple of PP_PANEL_ROWS */
    int64_t  k;            /* values per row, a multiple of PP_PANEL_BLOCK */
    uint8_t *data;         /* n_rows / 8 panels of k / 32 blocks; owned */
} pp_q8_panels;

/* The kernel a CPU runs, which instruction set multiplies the panels: enum
 * pp_panel_kernel of pyllama_paged.h (pp_model_pack_panels reports it). */

/* The fastest kernel this CPU has (PYLLAMA_PAGED_KERNELS=generic: scalar). */
enum pp_panel_kernel pp_panel_kernel_select(void);

/* Whether a [k, n_rows] weight of this type can be packed for this kernel
 * (the AVX2 kernel multiplies K panels only: its 16-bit pair sums would
 * saturate on Q8_0's codes). */
int pp_q8_panels_fit(enum ggml_type type, int64_t k, int64_t n_rows, enum pp_panel_kernel kernel);
static inline int pp_panel_type_is_k(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;
}
/* Float panels: their GEMM reads f32 activation columns, not quantized ones. */
static inline int pp_panel_type_is_float(enum ggml_type type) {
    return type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
}

/* Pack a Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K, F16 or BF16 [k, n_rows] weight (GGML's row layout)
 * into panels, allocated here; NULL when out of memory or when it does not
 * fit. */
pp_q8_panels *pp_q8_panels_pack(const void *data, enum ggml_type type, int64_t k, int64_t n_rows);
/* The same in two parts, so that threads can share a weight: the panels
 * allocated (untouched; NULL as above), then panels [p0, p1) packed from
 * the weight's GGML rows. */
pp_q8_panels *pp_q8_panels_alloc(enum ggml_type type, int64_t k, int64_t n_rows);
void pp_q8_panels_pack_range(pp_q8_panels *p, const void *data, int64_t p0, int64_t p1);
void pp_q8_panels_free(pp_q8_panels *p);

/* One row as f32 (the tied input embedding). */
void pp_q8_panels_row(const pp_q8_panels *p, int64_t row, float *out);

/* Per weight and compute context: the chunk counter the GEMM's threads
 * share, rearmed each time the op is put in a graph. */
typedef struct pp_panel_gemm_state {
    const pp_q8_panels *w;
    enum pp_panel_kernel kernel;
    atomic_int          next_chunk;
} pp_panel_gemm_state;

/* Graph ops. pp_panel_quantize: x [k, n] f32 -> its columns as the kernels
 * read them (one op, shared by the products of the same x);
 * pp_panel_gemm: those columns (float panels: x itself, rows of k f32
 * values) -> [n_rows, n] f32, panel chunks taken
 * dynamically by the threads; pp_panel_embed: tokens [n] i32 -> rows [k, n]
 * f32 of a (tied) head's panels. */
struct ggml_tensor *pp_panel_quantize(struct ggml_context *ctx, struct ggml_tensor *x,
                                      enum pp_panel_kernel kernel);
struct ggml_tensor *pp_panel_gemm(struct ggml_context *ctx, pp_panel_gemm_state *state,
                                  struct ggml_tensor *cols);
struct ggml_tensor *pp_panel_embed(struct ggml_context *ctx, const pp_q8_panels *w,
                                   struct ggml_tensor *tokens);

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
/* K panels' storage (kquant_panels.c): bytes per panel superblock; pack a
 * GGML [k, n_rows] weight's panels [p0, p1) into out (n_rows / 8 * k / 256 superblocks); the
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
void pp_kpanel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                           size_t col_stride, int64_t n, float *out, size_t ldo);

/* Float panels' storage (float_panels.c): pack panels [p0, p1) of a GGML
 * [k, n_rows] F16 or BF16 weight into out (n_rows x k 16-bit values); one
 * row as f32; the kernels, which read f32 columns (col_stride bytes apart). */
void pp_fpanel_pack(const void *data, int64_t k, int64_t p0, int64_t p1, uint8_t *out);
void pp_fpanel_row(const pp_q8_panels *w, int64_t row, float *out);
void pp_fpanel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                           size_t col_stride, int64_t n, float *out, size_t ldo);

/* Rows [p0 * 8, p1 * 8) of the product for columns [0, n): out[c * ldo + row]. */
typedef void (*pp_panel_kernel_fn)(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                                   size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_panel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                          size_t col_stride, int64_t n, float *out, size_t ldo);
/* One column into that layout: portable, and on AVX2 (the same bytes). */
typedef void (*pp_panel_quantize_fn)(const float *x, int64_t k, uint8_t *col);
/* Whether this CPU runs kernel k; the kernel for a weight type; the
 * quantizer that goes with the kernel. */
int pp_panel_kernel_runs_here(enum pp_panel_kernel k);
pp_panel_kernel_fn pp_panel_kernel_for(enum pp_panel_kernel k, enum ggml_type type);
pp_panel_quantize_fn pp_panel_quantizer_for(enum pp_panel_kernel k);
void pp_panel_quantize_column(const float *x, int64_t k, uint8_t *col);
/* Block b's sums into a column (both quantizers): the offset, scaled sum
 * and half-block offsets from the halves' byte sums. */
void pp_panel_column_sums(uint8_t *col, int64_t k, int64_t b, float scale, int32_t half0, int32_t half1);
#if defined(__x86_64__)
void pp_panel_quantize_column_avx2(const float *x, int64_t k, uint8_t *col);
void pp_panel_gemm_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                              size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_panel_gemm_avxvnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                           size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_kpanel_widen_codes_avx2(const pp_q8_panels *w, int64_t pi, uint8_t *codes);
void pp_kpanel_widen_scales_avx2(const pp_q8_panels *w, int64_t pi, pp_kpanel *out);
void pp_kpanel_gemm_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                               size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_kpanel_gemm_avxvnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                            size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_kpanel_gemm_avx2(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                         size_t col_stride, int64_t n, float *out, size_t ldo);
/* Float panels: AVX-512F (run with the AVX-512 VNNI kernel) and AVX2 + FMA + F16C. */
void pp_fpanel_gemm_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                               size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_fpanel_gemm_avx2(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                         size_t col_stride, int64_t n, float *out, size_t ldo);
/* BF16 panels with the AVX-512 kernel: AVX-512 BF16 dot products on the
 * activations rounded to BF16, as GGML's BF16 products round them, where
 * the CPU has them; the FMA kernel otherwise. */
void pp_fpanel_gemm_bf16_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                                    size_t col_stride, int64_t n, float *out, size_t ldo);
#endif
/* Whether BF16 panels run on BF16 dot products here (AVX-512 BF16;
 * PYLLAMA_PAGED_BF16_DOT=0 keeps the FMA kernel). */
int pp_fpanel_bf16_dot_runs_here(void);

#endif
