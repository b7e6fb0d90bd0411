/*
 * pyllama_paged_testing.h: functions of pyllama-paged's native core that only
 * tests and benchmarks use. The library exports them beside the contract of
 * pyllama_paged.h, whose conventions hold here too (int32_t statuses, split
 * by sign; a failing call changes nothing; pp_last_error() says why), but
 * nothing in the engine calls them and they may change between versions.
 *
 * Python binds this header with cffi after pyllama_paged.h: plain C only,
 * fixed-width integers, no macros inside declarations.
 */
#ifndef PYLLAMA_PAGED_TESTING_H
#define PYLLAMA_PAGED_TESTING_H

#include "pyllama_paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- block pool --------------------------------------------------------- */

/* Keep only the low `bits` bits (1..64) of every block hash this pool
 * computes, so tests can produce hash collisions on purpose (64: full
 * strength, the default). PP_ERR_INVALID for a NULL pool, bits outside
 * 1..64, or unless the pool holds no sequence and no cached block (then
 * nothing changes). Not for production use. */
int32_t pp_pool_weaken_hash(pp_block_pool *pool, int32_t bits);

/* ---- attention harness --------------------------------------------------- */

/* The attention operators alone, on a KV pool of num_slots token rows of
 * kv_type, outside any model: for checking the paged kernel against a plain
 * softmax(QK^T)V and timing it against GGML's contiguous flash attention. */
typedef struct pp_attention_harness pp_attention_harness;

/* Create a harness: a zeroed K and V pool of num_slots rows of n_head_kv *
 * head_dim values of kv_type (F16, Q8_0 or Q4_0), n_head query heads and
 * n_threads threads. On success *out owns it; free it with
 * pp_attention_harness_destroy. PP_ERR_INVALID for a bad type or shape,
 * PP_ERR_NO_MEMORY if the pool or the kernel's tiles cannot be had. */
int32_t pp_attention_harness_create(int32_t kv_type, int32_t num_slots, int32_t n_head,
                                    int32_t n_head_kv, int32_t head_dim, int32_t n_threads,
                                    pp_attention_harness **out);

/* Destroy a harness. NULL is accepted. */
void pp_attention_harness_destroy(pp_attention_harness *h);

/* Store n token rows of K and V (f32, [n][n_head_kv * head_dim], borrowed)
 * at the given slots, converted to the pool's type. PP_ERR_INVALID (nothing
 * stored) for a NULL argument or a slot outside the pool. */
int32_t pp_attention_harness_write(pp_attention_harness *h, const int32_t *slots, int32_t n,
                                   const float *k, const float *v);

/* The pool's K and V rows at slots, converted back to f32 (what the kernel
 * sees), into the caller's k and v ([n][n_head_kv * head_dim]). Errors as
 * pp_attention_harness_write. */
int32_t pp_attention_harness_read(const pp_attention_harness *h, const int32_t *slots, int32_t n,
                                  float *k, float *v);

/* Attention sinks for later calls (both operators): n_head f32 logits, each
 * joining its head's softmax as a key of value 0 (gpt-oss), copied; NULL:
 * none again. PP_ERR_INVALID for a NULL harness. */
int32_t pp_attention_harness_set_sinks(pp_attention_harness *h, const float *sinks);

/* Paged attention for the batch's tokens (token_ids and slot_mapping are
 * ignored; positions, seq_index and block tables are used) with pages of
 * block_size slots. q and out: [n_tokens][n_head][head_dim] f32, out the
 * caller's. PP_ERR_INVALID (nothing computed) for an empty or malformed
 * batch or a block outside the pool; PP_ERR_NO_MEMORY if the graph cannot
 * be allocated; PP_ERR_COMPUTE if GGML fails (out undefined). */
int32_t pp_attention_harness_paged(pp_attention_harness *h, const pp_batch *batch, int32_t block_size,
                                   int32_t window, float scale, const float *q, float *out);

/* GGML's flash attention of n_q queries at positions over the contiguous
 * slots [first_slot, first_slot + n_kv), with a causal (and window) mask.
 * q and out as pp_attention_harness_paged; errors likewise (PP_ERR_INVALID
 * for a slot range outside the pool). */
int32_t pp_attention_harness_contiguous(pp_attention_harness *h, int32_t first_slot, int32_t n_kv,
                                        int32_t n_q, const int32_t *positions, int32_t window,
                                        float scale, const float *q, float *out);

/* ---- panel GEMM ----------------------------------------------------------- */

/* GGML's own quantization of n_rows rows of k f32 values into ggml type
 * `type` (dst: n_rows * the type's row size, the caller's), and its
 * dequantization back (dst: n_rows * k f32). PP_ERR_INVALID for a type GGML
 * cannot quantize this way or k not a multiple of its block. */
int32_t pp_ggml_quantize_rows(int32_t type, const float *src, int64_t n_rows, int64_t k, void *dst);
int32_t pp_ggml_dequantize_rows(int32_t type, const void *src, int64_t n_rows, int64_t k, float *dst);
/* Bytes of one row of k values of ggml type `type`; -1 for an unknown type
 * or a k that is not a whole number of its blocks. */
int64_t pp_ggml_row_bytes(int32_t type, int64_t k);

/* 1 if this CPU runs panel kernel `kernel` (enum pp_panel_kernel), else 0. */
int32_t pp_panel_kernel_available(int32_t kernel);
/* 1 if BF16 panels run on BF16 dot products with the AVX-512 kernel here
 * (their activations are then rounded to BF16), else 0. */
int32_t pp_panel_bf16_dot_available(void);

/* The panel GEMM alone: pack a [k, n_rows] weight of ggml type `type`
 * (borrowed, GGML's row layout) into panels, quantize the n columns of x
 * (f32 [n][k], borrowed) as the graph does and multiply them with `kernel`
 * (enum pp_panel_kernel) into out (f32 [n][n_rows], the caller's).
 * PP_ERR_INVALID for a type or shape the panels do not take, or a kernel
 * this CPU cannot run; PP_ERR_NO_MEMORY if the panels cannot be had. */
int32_t pp_panel_gemm_run(int32_t type, int64_t k, int64_t n_rows, const void *weight, const float *x,
                          int64_t n, int32_t kernel, float *out);

/* Row `row` of such a packed weight as f32 (what a tied embedding reads),
 * into out (k f32, the caller's). Errors as pp_panel_gemm_run, and
 * PP_ERR_INVALID for a row outside the weight. */
int32_t pp_panel_row_run(int32_t type, int64_t k, int64_t n_rows, const void *weight, int64_t row, float *out);

/* How a panel GEMM's threads share a weight of n_panels panels, run
 * without data: n_threads threads (at most 16) take chunks of at most
 * `chunk` panels. Entry i of `schedule` (n_schedule thread indices) is one
 * request by that thread; then every thread the schedule lists asks until
 * it gets nothing, in index order (a thread never listed is one the OS never
 * ran). Each chunk given out is written to claims (the caller's, 3 x
 * max_claims int64: thread, first panel, end panel). Returns the number of
 * chunks, or -1 with PP_ERR_INVALID set for bad arguments or more chunks
 * than max_claims (PP_ERR_NO_MEMORY if no memory). */
int64_t pp_panel_chunks_run(int64_t n_panels, int32_t n_threads, int64_t chunk, const int32_t *schedule,
                            int32_t n_schedule, int64_t *claims, int64_t max_claims);

/* ---- step graph introspection --------------------------------------------- */

/* One node of a context's last step graph as GGML's CUDA backend compares it
 * before replaying a captured CUDA graph (ggml-cuda's update rule: the whole
 * tensor struct, and each source's data pointer, ne and nb). Addresses are
 * plain integers (0: none); sizes match GGML 0.20.2 (10 sources, 64-byte
 * names, 16 op parameters). */
typedef struct pp_graph_node {
    char     op[32];              /* ggml_op_desc: the op, or the unary/glu op's name */
    char     name[64];
    int32_t  type;                /* enum ggml_type */
    int32_t  flags;
    int64_t  ne[4];
    uint64_t nb[4];
    int32_t  op_params[16];
    uint64_t self;                /* the tensor's own address (a CUDA graph's key is nodes[0]'s) */
    uint64_t data;
    uint64_t buffer;
    uint64_t view_src;
    uint64_t view_offs;
    uint64_t extra;
    uint64_t src[10];             /* the sources' addresses */
    uint64_t src_data[10];        /* and what the rule reads of them (zero where no source) */
    int64_t  src_ne[10][4];
    uint64_t src_nb[10][4];
    uint64_t props_hash;          /* FNV-1a over the struct's bytes and the sources' data, ne, nb:
                                     equal hashes, equal properties for the rule */
    int32_t  backend;             /* the scheduler's backend index (0: the device), -1 without one */
    int32_t  on_host;             /* 1: the node's buffer is in host memory (or it has none) */
} pp_graph_node;

/* The nodes of the context's last step graph (the one its last decode ran),
 * in execution order, into out (the caller's, `capacity` entries); *n_nodes
 * receives the graph's node count even when it exceeds capacity (then only
 * the first `capacity` are written). PP_ERR_INVALID for a NULL argument or a
 * negative capacity, or when the context has no graph (no step yet, or the
 * last one failed). Reads only: the graph stays as it was. */
int32_t pp_context_graph_nodes(const pp_context *ctx, pp_graph_node *out, int32_t capacity, int32_t *n_nodes);

#ifdef __cplusplus
}
#endif

#endif /* PYLLAMA_PAGED_TESTING_H */
