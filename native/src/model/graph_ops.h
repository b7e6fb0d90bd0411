/* The pieces of a step's decoder graph (graph.c) that architectures with a
 * graph builder of their own (gemma4_graph.c) share. Every function adds
 * nodes to ctx and returns the new tensor; none allocates memory or fails
 * (GGML asserts on shapes that do not fit). */
#ifndef PP_GRAPH_OPS_H
#define PP_GRAPH_OPS_H

#include "common/engine_internal.h"
#include "panels/panels.h"

/* A step's input tensors (see pp_build_graph); pp_panel_columns (engine_internal.h) starts a
 * graph as {0}. */
typedef struct pp_graph_inputs {
    struct ggml_tensor *tokens, *positions, *slots;
    struct ggml_tensor *rows;              /* logit rows, then hidden rows */
    struct ggml_tensor *mrope_positions;   /* hybrids: IMRoPE's four components per token */
    struct ggml_tensor *state_slots;       /* hybrids: one state slot per run */
} pp_graph_inputs;

/* RMSNorm of x's rows times weight. */
struct ggml_tensor *pp_graph_norm(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *weight,
                                  float eps);

/* The step's inputs (into *in; not the hybrids' two) and its token embeddings times hp.embd_scale
 * [n_embd, n_tokens], the batch's given embeddings (pp_batch embd) in their rows. */
struct ggml_tensor *pp_graph_embed(struct ggml_context *ctx, const pp_model *m, const pp_kv_cache *cache,
                                   const pp_batch *batch, pp_panel_gemm_state *gemm_states, pp_graph_inputs *in);

/* Layer il's K and V of this step ([head_dim, n_head_kv, n_tokens], or v as [n_embd_kv, n_tokens])
 * written to its slots in its group's run of slots; pools[0], pools[1]: the K and V pools after
 * the writes (what attention must read, so that it runs after them). */
void pp_graph_write_kv(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_kv_cache *cache, int il,
                       const pp_attention_params *ap, struct ggml_tensor *slots, struct ggml_tensor *k,
                       struct ggml_tensor *v, struct ggml_tensor *pools[2]);

/* Attention of q [head_dim, n_head, n_tokens] over the pools layer il reads (pools[0], pools[1]):
 * our paged operator for host pages, else GGML's flash attention. */
struct ggml_tensor *pp_graph_attention(struct ggml_context *ctx, const pp_kv_cache *cache, const pp_batch *batch,
                                       int il, struct ggml_tensor *q, struct ggml_tensor *pools[2],
                                       pp_attention_params *ap, int n_threads, int gather);

/* The layer's dense gated FFN (GELU for the gemmas, else SiLU) of cur [n_embd, n_tokens]; gs: the
 * layer's PP_N_PROJ panel slots or NULL (it reads those from pp_dense_ffn_slot on); lora: the
 * step's adapters (model/lora.h) for layer il, or NULL. */
struct ggml_tensor *pp_graph_dense_ffn(struct ggml_context *ctx, enum pp_arch arch, const pp_layer *L,
                                       pp_panel_gemm_state *gs, struct pp_lora_plan *lora, int il,
                                       struct ggml_tensor *cur, pp_panel_columns *last);

/* The graph's end from the last layer's output x (its asked-for rows): the output norm, the
 * hidden rows ("hidden"), the head and its soft-cap ("logits"). Returns gf. */
struct ggml_cgraph *pp_graph_output(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_model *m,
                                    const pp_batch *batch, struct ggml_tensor *x, pp_panel_gemm_state *head,
                                    pp_panel_columns *last);

/* moe_graph.c: each token's n_used experts by the softmax of logits [n_expert, n_tokens] over
 * all experts (I32 [n_used, n_tokens], by falling probability), and in *weights [1, n_used,
 * n_tokens] their probabilities renormalised to sum to 1 (llama.cpp's softmax gating). */
struct ggml_tensor *pp_moe_softmax_route(struct ggml_context *ctx, struct ggml_tensor *logits, int n_used,
                                         struct ggml_tensor **weights);

/* moe_graph.c: experts [n_embd, n_used, n_tokens] times weights [1, n_used, n_tokens], summed
 * over each token's experts -> [n_embd, n_tokens]. */
struct ggml_tensor *pp_moe_weighted_sum(struct ggml_context *ctx, struct ggml_tensor *experts,
                                        struct ggml_tensor *weights);

/* gemma4_graph.c: Gemma 4's step graph (pp_build_graph's contract). */
struct ggml_cgraph *pp_build_gemma4_graph(struct ggml_context *ctx, const pp_model *m, const pp_kv_cache *cache,
                                          const pp_batch *batch, pp_attention_params *layer_params,
                                          pp_panel_gemm_state *gemm_states, int n_threads, int gather,
                                          size_t max_nodes);

/* gemma4_graph.c: a Gemma 4 layer's routed experts (the layer must have them) of moe_in [n_embd,
 * n_tokens] routed by the residual after attention h: softmax over all experts of the router's
 * logits for rmsnorm(h) / sqrt(n_embd) * its scale, the top n_expert_used renormalised, GELU-gated
 * experts times their output scales. gs as for pp_graph_dense_ffn (its GATE, UP and DOWN slots
 * hold the experts' panels, if packed). */
struct ggml_tensor *pp_build_gemma4_moe_ffn(struct ggml_context *ctx, const pp_model_hparams *hp,
                                            const pp_layer *L, pp_panel_gemm_state *gs, struct ggml_tensor *moe_in,
                                            struct ggml_tensor *h);

#endif
