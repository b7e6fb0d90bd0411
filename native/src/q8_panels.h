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
 * into the compute layout (value - 16 + 128), on the stack. */
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
/* Longest Q5_0 row: one widened panel (k / 32 x 272 bytes) lives on the stack. */
#define PP_PANEL_MAX_K 8192

typedef struct pp_q8_panels {
    enum ggml_type type;   /* storage: GGML_TYPE_Q8_0 (compute layout) or GGML_TYPE_Q5_0 */
    int64_t  n_rows;       /* output rows, a multiple of PP_PANEL_ROWS */
    int64_t  k;            /* values per row, a multiple of PP_PANEL_BLOCK */
    uint8_t *data;         /* n_rows / 8 panels of k / 32 blocks; owned */
} pp_q8_panels;

/* The kernel a CPU runs, which instruction set multiplies the panels: enum
 * pp_panel_kernel of pyllama_paged.h (pp_model_pack_panels reports it). */

/* The fastest kernel this CPU has (PYLLAMA_PAGED_KERNELS=generic: scalar). */
enum pp_panel_kernel pp_panel_kernel_select(void);

/* Whether a [k, n_rows] weight of this type can be packed. */
int pp_q8_panels_fit(enum ggml_type type, int64_t k, int64_t n_rows);

/* Pack a Q8_0 or Q5_0 [k, n_rows] weight (GGML's row layout) into panels,
 * allocated here; NULL when out of memory or when it does not fit. */
pp_q8_panels *pp_q8_panels_pack(const void *data, enum ggml_type type, int64_t k, int64_t n_rows);
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
 * pp_panel_gemm: those columns -> [n_rows, n] f32, panel chunks taken
 * dynamically by the threads; pp_panel_embed: tokens [n] i32 -> rows [k, n]
 * f32 of a (tied) head's panels. */
struct ggml_tensor *pp_panel_quantize(struct ggml_context *ctx, struct ggml_tensor *x,
                                      enum pp_panel_kernel kernel);
struct ggml_tensor *pp_panel_gemm(struct ggml_context *ctx, pp_panel_gemm_state *state,
                                  struct ggml_tensor *cols);
struct ggml_tensor *pp_panel_embed(struct ggml_context *ctx, const pp_q8_panels *w,
                                   struct ggml_tensor *tokens);

/* The column layout the quantize op writes and the kernels read: k signed
 * bytes, then k / 32 float scales, then k / 32 int32 offsets (-128 times
 * the block's byte sum, taking the weights' +128 back out). */
static inline size_t pp_panel_column_bytes(int64_t k) {
    return (size_t)k + (size_t)(k / PP_PANEL_BLOCK) * 8;
}

/* Rows [p0 * 8, p1 * 8) of the product for columns [0, n): out[c * ldo + row]. */
typedef void (*pp_panel_kernel_fn)(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                                   size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_panel_gemm_scalar(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                          size_t col_stride, int64_t n, float *out, size_t ldo);
/* One column into that layout: portable, and on AVX2 (the same bytes). */
typedef void (*pp_panel_quantize_fn)(const float *x, int64_t k, uint8_t *col);
void pp_panel_quantize_column(const float *x, int64_t k, uint8_t *col);
#if defined(__x86_64__)
void pp_panel_quantize_column_avx2(const float *x, int64_t k, uint8_t *col);
void pp_panel_gemm_avx512vnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                              size_t col_stride, int64_t n, float *out, size_t ldo);
void pp_panel_gemm_avxvnni(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                           size_t col_stride, int64_t n, float *out, size_t ldo);
#endif

#endif
