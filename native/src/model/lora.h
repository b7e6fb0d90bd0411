/* LoRA adapters inside the library: an adapter's weights (lora.c) and how a
 * step's graph adds them to the base model's products (lora_graph.c). */
#ifndef PP_LORA_H
#define PP_LORA_H

#include "common/engine_internal.h"

/* One adapted projection: y += factor * user_scale * B (A x), A [in, rank]
 * and B [rank, out] in GGML order; factor = alpha / rank (1 when the
 * adapter's alpha is 0, as llama.cpp reads it). */
typedef struct pp_lora_pair {
    struct ggml_tensor *a, *b;
    float factor;
} pp_lora_pair;

/* lora.c: the pair adapting layer il's projection proj (enum pp_projection),
 * or NULL when the adapter leaves it alone. */
const pp_lora_pair *pp_lora_pair_of(const pp_lora *lora, int il, int proj);

/* lora.c: a number no other adapter of this process has had: a step graph's
 * shape names its adapters by it (an address can be reused after a free). */
uint64_t pp_lora_uid(const pp_lora *lora);

/* lora.c: the model an adapter was made for, and whether it is finalized. */
const pp_model *pp_lora_model(const pp_lora *lora);
int pp_lora_is_final(const pp_lora *lora);

/* lora_graph.c: which adapter each column of a step's products runs, and the
 * graph inputs that gather them; owned by a context, rebuilt every step. */
typedef struct pp_lora_plan pp_lora_plan;

/* A plan for steps of at most max_tokens tokens and max_loras adapters.
 * PP_ERR_NO_MEMORY, or PP_ERR_INVALID for a bad size. */
int32_t pp_lora_plan_create(int32_t max_loras, int32_t max_tokens, pp_lora_plan **out);
void pp_lora_plan_destroy(pp_lora_plan *plan);
int32_t pp_lora_plan_max_loras(const pp_lora_plan *plan);

/* Fill the plan from the batch's adapters (pp_batch.loras ...), checking
 * them: PP_ERR_INVALID for an adapter of another model, one not finalized,
 * an index outside loras, a non-finite scale, more adapters than the plan
 * holds. plan may be NULL for a batch without adapters. Returns the number
 * of adapters the step runs in *n_active. */
int32_t pp_lora_plan_make(pp_lora_plan *plan, const pp_model *m, const pp_batch *b, int32_t *n_active);

/* A hash of what the plan's graph nodes depend on (the adapters, each one's
 * column counts); 0 when the step runs none. */
uint64_t pp_lora_plan_shape(const pp_lora_plan *plan);

/* Before a new graph is built: its inputs do not exist yet. */
void pp_lora_plan_reset_inputs(pp_lora_plan *plan);

/* The step's column orders and scales into the graph's inputs. */
void pp_lora_plan_upload(const pp_lora_plan *plan);

/* y = base product of layer il's projection proj over x [in, n], with each
 * column's adapter added; y itself when the step runs no adapter there.
 * plan NULL: none this step. */
struct ggml_tensor *pp_lora_project(struct ggml_context *ctx, pp_lora_plan *plan, int il, int proj,
                                    struct ggml_tensor *x, struct ggml_tensor *y);

/* Whether some adapter of the step changes layer il's gate or up products
 * (their fused panel product cannot take an adapter's addition). */
int pp_lora_touches_gated(const pp_lora_plan *plan, int il);

/* Graph nodes a step of max_loras adapters may add to a model of n_layer layers. */
size_t pp_lora_graph_nodes(int n_layer, int max_loras);

#endif
