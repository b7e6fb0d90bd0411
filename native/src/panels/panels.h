/* Weights in row panels for our VNNI integer GEMM (the "panel GEMM"): what
 * the rest of the library calls (panels.c, the one dispatcher over the
 * formats); each format's own functions are in panel_formats.h.
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
 * MXFP4 weights (gpt-oss's experts) keep their 17 bytes per row-block
 * (136 per panel-block: the 8 rows' E8M0 exponents, then their 4-bit codes
 * as Q4_0 panels hold nibbles), see mxfp4_panels.c: a byte shuffle turns a
 * group of codes into unsigned bytes (twice the E2M1 value, plus a bias the
 * column's byte sum takes back out) and the exponents become f32 scales.
 *
 * F16 and BF16 weights ("float panels", float_panels.c) keep their 16-bit
 * values in [quad of 4 values][8 rows][4] order and multiply the f32
 * activations themselves: no quantize op, f32 FMAs. */
#ifndef PP_PANELS_H
#define PP_PANELS_H

#include "pyllama_paged.h"
#include "ggml.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>

#define PP_PANEL_ROWS 8

typedef struct pp_q8_panels {
    enum ggml_type type;   /* storage: GGML_TYPE_Q8_0 (compute layout), Q5_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, F16 or BF16 */
    int64_t  n_rows;       /* output rows, a multiple of PP_PANEL_ROWS */
    int64_t  k;            /* values per row, a multiple of PP_PANEL_BLOCK */
    uint8_t *data;         /* n_rows / 8 panels of k / 32 blocks; owned */
} pp_q8_panels;

/* The kernel a CPU runs, which instruction set multiplies the panels: enum
 * pp_panel_kernel of pyllama_paged.h (pp_model_pack_panels reports it). */

/* The fastest kernel this CPU has (PYLLAMA_PAGED_KERNELS=generic: scalar). */
enum pp_panel_kernel pp_panel_kernel_select(void);

/* Whether a [k, n_rows] weight of this type can be packed for this kernel
 * (the AVX2 kernel multiplies K, MXFP4 and float panels only: its 16-bit
 * pair sums would saturate on Q8_0's codes). */
int pp_q8_panels_fit(enum ggml_type type, int64_t k, int64_t n_rows, enum pp_panel_kernel kernel);
static inline int pp_panel_type_is_k(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;
}
/* Float panels: their GEMM reads f32 activation columns, not quantized ones. */
static inline int pp_panel_type_is_float(enum ggml_type type) {
    return type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
}

/* Pack a Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, F16 or BF16 [k, n_rows] weight (GGML's row layout)
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

/* Bytes of the panels of a [k, n_rows] weight of this type (0: it does not fit). */
size_t pp_q8_panels_bytes(enum ggml_type type, int64_t k, int64_t n_rows);

/* A layer's expert matrices ([k, n_rows, n_expert] in GGUF, see
 * expert_panels.c), each expert's [k, n_rows] slice in panels of its own,
 * all in one allocation. */
typedef struct pp_expert_panels {
    int64_t       n_expert;
    size_t        panel_bytes;   /* one 8-row panel of an expert, as stored */
    pp_q8_panels *experts;       /* [n_expert]: their data points into `data`; owned */
    uint8_t      *data;          /* owned */
} pp_expert_panels;

/* Allocate (untouched) the panels of n_expert [k, n_rows] matrices of a
 * quantized or float panel type; NULL when out of memory or when they do
 * not fit. Pack each expert with pp_q8_panels_pack_range(&ep->experts[e], ...);
 * free with pp_expert_panels_free (never pp_q8_panels_free on an expert). */
pp_expert_panels *pp_expert_panels_alloc(enum ggml_type type, int64_t k, int64_t n_rows, int64_t n_expert);
void pp_expert_panels_free(pp_expert_panels *ep);

/* Threads of a step that split a weight's panels in ranges of their own;
 * more take chunks from one shared counter. */
#define PP_PANEL_MAX_RANGES 16

/* One thread's range of panels [lo, hi), packed lo | hi << 32: the owner
 * takes chunks from the front, threads done with their own from the back;
 * a line of its own, as two threads write it. */
typedef struct pp_panel_range {
    _Alignas(64) _Atomic uint64_t lo_hi;
} pp_panel_range;

/* Per weight and compute context: how the GEMM's threads share its panels,
 * rearmed before each compute of a graph. A dense weight's panels are split
 * in one contiguous range per thread: each thread streams its own bytes in
 * order (chunks taken from a shared counter interleave the threads, and a
 * decode step's small projections ran 7% slower so), and a thread done
 * early takes chunks from the end of another's range, so a descheduled
 * thread holds up at most the chunk it is in. An expert slot has experts
 * set and w NULL, and its items come from next_chunk. */
typedef struct pp_panel_gemm_state {
    const pp_q8_panels *w;
    const pp_expert_panels *experts;
    enum pp_panel_kernel kernel;
    atomic_int          next_chunk;
    int32_t             n_ranges;    /* threads the ranges were cut for (0: none) */
    pp_panel_range      ranges[PP_PANEL_MAX_RANGES];
} pp_panel_gemm_state;

/* Rearm the states for a compute on n_threads threads (ranges, counters):
 * before each compute of a graph that reads them (a graph may run many
 * times), never while one runs. */
void pp_panel_gemm_rearm(pp_panel_gemm_state *states, int n, int n_threads);

/* The next chunk [*p0, *p1) of at most `chunk` panels thread ith (of nth)
 * computes, from its own range and then from the others' (*cursor: 0 at
 * the op's start, advanced here); from next_chunk when the ranges were cut
 * for another number of threads. 0 when no panel is left. */
int pp_panel_next_chunk(pp_panel_gemm_state *st, int ith, int nth, int64_t n_panels, int64_t chunk, int *cursor,
                        int64_t *p0, int64_t *p1);

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

/* A dense FFN's act(gate x) * up x in one op (gated_panels.c), any number
 * of columns: gate_up points at two adjacent states, gate's then up's, both
 * with panels of one kind (float or quantized: they read the same columns,
 * made as for pp_panel_gemm) and the same shape (pp_panel_gated_takes says
 * whether they are); gelu: GELU's tanh form, else SiLU. -> [n_rows, n] f32;
 * the chunk counter is gate's. */
int pp_panel_gated_takes(const pp_panel_gemm_state *gate_up);
struct ggml_tensor *pp_panel_gated(struct ggml_context *ctx, pp_panel_gemm_state *gate_up, struct ggml_tensor *cols,
                                   int gelu);

/* The experts' products of a step, as ggml_mul_mat_id computes them, with
 * the step's (token, slot) pairs grouped by expert so that each expert's
 * panels are read once for all the tokens routed to it. A layer's route
 * starts as {selected} (I32 [n_used, n_tokens], each token's experts); the
 * grouping and the last input's grouped columns are made on first use and
 * shared by the layer's later products (gate and up read the same columns).
 * pp_expert_matmul: w [k, n_rows, n_expert] times x [k, 1 or n_used,
 * n_tokens] f32 -> [n_rows, n_used, n_tokens] f32, through the experts'
 * panels when state has them, else GGML's ggml_mul_mat_id. */
typedef struct pp_expert_route {
    struct ggml_tensor *selected;
    struct ggml_tensor *grouping;   /* NULL until a panel product needs it */
    struct ggml_tensor *x, *cols;   /* the last input and its grouped columns */
} pp_expert_route;
struct ggml_tensor *pp_expert_matmul(struct ggml_context *ctx, pp_expert_route *route, struct ggml_tensor *w,
                                     pp_panel_gemm_state *state, struct ggml_tensor *x);

/* Rows [p0 * 8, p1 * 8) of the product for columns [0, n): out[c * ldo + row].
 * Every format's kernels have this type (panel_formats.h). */
typedef void pp_panel_gemm_kernel(const pp_q8_panels *w, int64_t p0, int64_t p1, const uint8_t *cols,
                                  size_t col_stride, int64_t n, float *out, size_t ldo);
typedef pp_panel_gemm_kernel *pp_panel_kernel_fn;
/* The head of a kernel's definition for TARGET's instructions (its parameters named as above). */
#define PP_PANEL_GEMM_KERNEL(NAME, TARGET)                                                                  \
    __attribute__((target(TARGET))) void NAME(const pp_q8_panels *w, int64_t p0, int64_t p1,               \
                                              const uint8_t *cols, size_t col_stride, int64_t n, float *out, \
                                              size_t ldo)
/* One column of x into the layout the quantized formats' kernels read. */
typedef void pp_panel_quantizer(const float *x, int64_t k, uint8_t *col);
typedef pp_panel_quantizer *pp_panel_quantize_fn;
/* Whether this CPU runs kernel k; the kernel for a weight type; the
 * quantizer that goes with the kernel. */
int pp_panel_kernel_runs_here(enum pp_panel_kernel k);
pp_panel_kernel_fn pp_panel_kernel_for(enum pp_panel_kernel k, enum ggml_type type);
pp_panel_quantize_fn pp_panel_quantizer_for(enum pp_panel_kernel k);

#endif
