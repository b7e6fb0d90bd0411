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

#ifdef __cplusplus
}
#endif

#endif /* PYLLAMA_PAGED_TESTING_H */
