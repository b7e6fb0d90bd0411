/* Structures shared by the model, KV cache, graph and kernel sources. */
#ifndef PP_ENGINE_INTERNAL_H
#define PP_ENGINE_INTERNAL_H

#include "pyllama_paged.h"
#include "common/pp_internal.h"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <stdatomic.h>
#include <sys/types.h>   /* pid_t */

#define PP_MAX_REPACK_BUFTS 8

struct pp_q8_panels;          /* panels/panels.h */
struct pp_expert_panels;
struct pp_panel_gemm_state;

typedef struct pp_layer {
    struct ggml_tensor *attn_norm;
    struct ggml_tensor *wq, *wk, *wv, *wo;
    struct ggml_tensor *bq, *bk, *bv;
    struct ggml_tensor *q_norm, *k_norm;
    struct ggml_tensor *post_attn_norm;
    struct ggml_tensor *ffn_norm;
    struct ggml_tensor *ffn_gate, *ffn_up, *ffn_down;
    struct ggml_tensor *post_ffw_norm;
    struct ggml_tensor *attn_sinks;   /* [n_head] f32: a learned logit per head in the softmax's denominator (gpt-oss), or NULL */
    /* mixture of experts (n_expert > 0; the dense ffn_gate/up/down are then NULL):
     * the router [n_embd, n_expert], each expert's gate and up [n_embd, n_ff_exp,
     * n_expert] and down [n_ff_exp, n_embd, n_expert] */
    struct ggml_tensor *ffn_gate_inp;
    struct ggml_tensor *ffn_gate_exps, *ffn_up_exps, *ffn_down_exps;
    /* gpt-oss's expert biases, f32: the router's [n_expert], a row per expert for gate
     * and up [n_ff_exp, n_expert] and down [n_embd, n_expert]; NULL elsewhere */
    struct ggml_tensor *ffn_gate_inp_b;
    struct ggml_tensor *ffn_gate_exps_b, *ffn_up_exps_b, *ffn_down_exps_b;
    struct ggml_tensor *bo;   /* the attention output's bias (bert, gpt-oss), or NULL */
    /* Gated DeltaNet (a hybrid's linear layers): the convolution's input projection
     * (attn_qkv [n_embd, channels]: q, k, v), the output gate z (attn_gate [n_embd, H_v S]),
     * the kernel [d_conv, channels] f32, dt bias and -exp(A_log) [H_v] f32, the write
     * strength and decay projections [n_embd, H_v], the per-head norm [S] and the output
     * projection [H_v S, n_embd] */
    struct ggml_tensor *ssm_in, *ssm_gate, *ssm_conv1d, *ssm_dt_b, *ssm_a;
    struct ggml_tensor *ssm_beta, *ssm_alpha, *ssm_norm, *ssm_out;
    /* a shared expert beside the routed ones (qwen35moe): its gate row [n_embd] f32 and SwiGLU */
    struct ggml_tensor *ffn_gate_inp_shexp, *ffn_gate_shexp, *ffn_up_shexp, *ffn_down_shexp;
    /* encoder (bert) only: post-norms with biases, FFN biases */
    struct ggml_tensor *attn_out_norm, *attn_out_norm_b;
    struct ggml_tensor *ffn_up_b, *ffn_down_b;
    struct ggml_tensor *layer_out_norm, *layer_out_norm_b;
    /* gemma4 (model/gemma4_model.c): the layer's output scale [1]; its per-layer embedding's
     * gate [n_embd, n_embd_per_layer], projection [n_embd_per_layer, n_embd] and norm; beside
     * the experts, the router's input scale [n_embd], the experts' input norm and the norms of
     * the dense and expert outputs; the experts' gate and up as one [n_embd, 2 n_ff_exp,
     * n_expert] (or NULL: ffn_gate_exps and ffn_up_exps) and their output scales [n_expert] */
    struct ggml_tensor *out_scale;
    struct ggml_tensor *per_layer_inp_gate, *per_layer_proj, *per_layer_post_norm;
    struct ggml_tensor *ffn_gate_inp_s, *ffn_pre_norm_2, *ffn_post_norm_1, *ffn_post_norm_2;
    struct ggml_tensor *ffn_gate_up_exps, *ffn_down_exps_s;
} pp_layer;

/* A decoder layer's matrix products, in the order of the model's panel slots: attention's,
 * the dense FFN's, a Gated DeltaNet layer's, a shared expert's and a dense FFN beside experts
 * (a layer has some of them). In a layer with experts the GATE, UP and DOWN slots hold the
 * experts' panels, and a dense FFN beside them (gemma4's) takes the BESIDE slots: a slot's
 * state serves one product a step (its chunk counter), and GGML's product in their place is
 * not batch invariant for every type. */
enum pp_projection {
    PP_PROJ_Q, PP_PROJ_K, PP_PROJ_V, PP_PROJ_O, PP_PROJ_GATE, PP_PROJ_UP, PP_PROJ_DOWN,
    PP_PROJ_SSM_IN, PP_PROJ_SSM_GATE, PP_PROJ_SSM_BETA, PP_PROJ_SSM_ALPHA, PP_PROJ_SSM_OUT,
    PP_PROJ_SHEXP_GATE, PP_PROJ_SHEXP_UP, PP_PROJ_SHEXP_DOWN,
    PP_PROJ_BESIDE_GATE, PP_PROJ_BESIDE_UP, PP_PROJ_BESIDE_DOWN, PP_N_PROJ
};

/* The slot of layer L's dense FFN gate (its up and down follow). */
static inline int pp_dense_ffn_slot(const pp_layer *L) {
    return L->ffn_gate_inp ? PP_PROJ_BESIDE_GATE : PP_PROJ_GATE;
}

/* Layer L's dense weight in panel slot proj, or NULL. */
static inline struct ggml_tensor *pp_layer_weight(const pp_layer *L, int proj) {
    struct ggml_tensor *w[PP_N_PROJ] = {
        L->wq, L->wk, L->wv, L->wo, NULL, NULL, NULL,
        L->ssm_in, L->ssm_gate, L->ssm_beta, L->ssm_alpha, L->ssm_out,
        L->ffn_gate_shexp, L->ffn_up_shexp, L->ffn_down_shexp};
    const int ffn = pp_dense_ffn_slot(L);
    w[ffn] = L->ffn_gate;
    w[ffn + 1] = L->ffn_up;
    w[ffn + 2] = L->ffn_down;
    return w[proj];
}

struct pp_model {
    pp_model_hparams    hp;
    int32_t            *layer_window;
    int32_t            *layer_recurrent;   /* hybrids: per layer, 1 for a Gated DeltaNet layer; NULL otherwise */
    int32_t             n_recurrent;       /* how many layers are recurrent (0: no state pool needed) */
    struct ggml_context *weights;   /* tensor metadata only; data is borrowed */
    struct ggml_tensor *tok_embd;
    struct ggml_tensor *output_norm;
    struct ggml_tensor *output;     /* NULL: tied to tok_embd */
    struct ggml_tensor *rope_freqs; /* NULL: none; else [n_rot / 2] f32 frequency divisors */
    pp_layer           *layers;
    /* encoder (bert) only: learned positions, token types, embedding norm */
    struct ggml_tensor *pos_embd, *tok_types, *embd_norm, *embd_norm_b;
    int                 finalized;
    /* Weights moved out of the mapping into GGML's CPU extra buffer types
     * (repacked layouts); the buffers own those tensors' bytes. */
    ggml_backend_buffer_t repack_buffers[PP_MAX_REPACK_BUFTS];
    int                 n_repack_buffers;   /* at most one per extra type, <= PP_MAX_REPACK_BUFTS */
    int                 repack_done;
    /* Weights packed into row panels for our VNNI GEMM (panels/panels.h), by
     * slot: layer il's projection p at il * PP_N_PROJ + p, then the output
     * head (tied: the input embedding too). NULL slots: GGML's own ops. */
    struct pp_q8_panels **panels;
    int32_t             n_panel_slots;
    /* By the same slots: a layer's expert tensors (its GATE, UP and DOWN
     * slots), each expert in panels of its own; NULL slots: ggml_mul_mat_id.
     * NULL: no expert was packed. */
    struct pp_expert_panels **expert_panels;
    /* Offloaded to a GGML device (pp_model_offload): layers from
     * device_first_layer on, and the output head and its norm when
     * device_output. The tensors there are copies the device buffer owns. */
    int32_t             device;               /* GGML device index; -1: all on the CPU */
    int32_t             device_first_layer;
    int32_t             device_output;
    struct ggml_context *device_weights;
    ggml_backend_buffer_t device_buffer;
    /* With a device: a CPU buffer over the mapping, the home of the weights
     * left there (it owns nothing). */
    ggml_backend_buffer_t mapped_buffer;
    /* gemma4: the per-layer shapes (hp's layer_* arrays, owned copies; NULL: uniform) and the
     * per-layer embeddings' token table [n_embd_per_layer * n_layer, n_vocab], projection
     * [n_embd, n_embd_per_layer * n_layer] and norm [n_embd_per_layer] */
    int32_t            *layer_shapes;   /* one allocation: head_dim, n_head_kv, n_rot, n_ff, kv_source */
    struct ggml_tensor *per_layer_tok_embd, *per_layer_model_proj, *per_layer_proj_norm;
};

/* Layer il's shapes: the per-layer arrays where the model has them, else the hyper-parameters'. */
static inline int32_t pp_layer_head_dim(const pp_model *m, int il) {
    return m->hp.layer_head_dim ? m->hp.layer_head_dim[il] : m->hp.head_dim;
}
static inline int32_t pp_layer_n_head_kv(const pp_model *m, int il) {
    return m->hp.layer_n_head_kv ? m->hp.layer_n_head_kv[il] : m->hp.n_head_kv;
}
static inline int32_t pp_layer_n_rot(const pp_model *m, int il) {
    return m->hp.layer_n_rot ? m->hp.layer_n_rot[il] : m->hp.n_rot;
}
static inline int32_t pp_layer_n_ff(const pp_model *m, int il) {
    return m->hp.layer_n_ff ? m->hp.layer_n_ff[il] : m->hp.n_ff;
}
/* The layer whose K/V pools layer il reads (il itself unless it shares an earlier layer's). */
static inline int32_t pp_layer_kv_source(const pp_model *m, int il) {
    return m->hp.layer_kv_source && m->hp.layer_kv_source[il] >= 0 ? m->hp.layer_kv_source[il] : il;
}
/* Values of one token's K (or V) row in layer il's pool. */
static inline int64_t pp_layer_n_embd_kv(const pp_model *m, int il) {
    return (int64_t)pp_layer_head_dim(m, il) * pp_layer_n_head_kv(m, il);
}

/* model/device.c: the model's device (NULL: none). */
ggml_backend_dev_t pp_model_device(const pp_model *m);

/* model/weight_repack.c: the borrowed bytes of a weight moved elsewhere
 * (repacked, packed into panels, offloaded to a device) are never read
 * again: ask the kernel to reclaim the whole pages inside them, keeping
 * their contents. */
void pp_release_mapped(const void *data, size_t size);

/* Whether layer il (il == n_layer: the output head) runs on the model's device. */
static inline int pp_layer_on_device(const pp_model *m, int il) {
    if (m->device < 0) return 0;
    return il >= m->hp.n_layer ? m->device_output : il >= m->device_first_layer;
}

struct pp_kv_cache {
    const pp_model      *model;
    enum ggml_type       type;
    int32_t              num_blocks;
    int32_t              block_size;
    int32_t              paged;
    int64_t              num_slots;
    struct ggml_context *meta;              /* the pools in host memory */
    ggml_backend_buffer_t buffer;
    struct ggml_context *device_meta;       /* the pools on the model's device (NULL: none) */
    ggml_backend_buffer_t device_buffer;
    int32_t              n_groups;          /* layer groups (1: ungrouped) */
    int32_t              n_pools;           /* distinct K (and V) tensors, see pp_kv_cache_create_grouped */
    int32_t             *layer_group;       /* per layer: its group (0 for a recurrent layer) */
    struct ggml_tensor **kt, **vt;          /* the n_pools distinct pools: [values per slot, num_slots] each */
    struct ggml_tensor **k;                 /* per layer: its rows, [n_embd_kv of the layer, num_slots]: a
                                               pool, a view of a pool's lane, or its KV source's; NULL for
                                               a hybrid's recurrent layers, which keep no KV */
    struct ggml_tensor **v;
};

/* The recurrent state pool (pyllama_paged.h): per linear layer a convolution and a
 * delta-rule tensor of num_slots rows (NULL for attention layers), in one host buffer. */
struct pp_state_pool {
    const pp_model      *model;
    int32_t              num_slots;
    int32_t              n_free;
    int64_t              bytes_per_slot;
    uint8_t             *taken;      /* per slot: 1 while a sequence holds it */
    struct ggml_context *meta;
    ggml_backend_buffer_t buffer;
    struct ggml_tensor **conv;       /* per layer: [(d_conv - 1) channels, num_slots] f32 */
    struct ggml_tensor **delta;      /* per layer: [S S H_v, num_slots] f32 */
};

/* A Gated DeltaNet layer's convolution channels (q, k, v) and its two states' sizes in floats. */
static inline int64_t pp_conv_channels(const pp_model_hparams *hp) {
    return (int64_t)(2 * hp->ssm_n_group + hp->ssm_dt_rank) * hp->ssm_d_state;
}
static inline int64_t pp_conv_state_floats(const pp_model_hparams *hp) {
    return (int64_t)(hp->ssm_d_conv - 1) * pp_conv_channels(hp);
}
static inline int64_t pp_delta_state_floats(const pp_model_hparams *hp) {
    return (int64_t)hp->ssm_d_state * hp->ssm_d_state * hp->ssm_dt_rank;
}

/* model/state_pool.c: zero one slot's states (no checks: the caller checked the slot). */
PP_HIDDEN void pp_state_pool_zero_slot(pp_state_pool *pool, int32_t slot);

/* A hybrid step's sequence runs (maximal spans of one sequence's tokens) cut into segments of
 * consecutive runs of one length: each is one ggml_gated_delta_net call per linear layer. */
#define PP_MAX_DELTA_SEGMENTS 128
typedef struct pp_delta_plan {
    int32_t n_runs;
    int32_t n_segments;
    int32_t seg_tokens[PP_MAX_DELTA_SEGMENTS];   /* tokens of each of the segment's runs */
    int32_t seg_runs[PP_MAX_DELTA_SEGMENTS];     /* its runs */
} pp_delta_plan;

/* What a hybrid step's graph needs besides the model and the batch. */
typedef struct pp_recurrent_step {
    const pp_state_pool *pool;
    const pp_delta_plan *plan;
} pp_recurrent_step;

/* model/delta_net_graph.c: the plan of batch b; PP_ERR_INVALID (naming the limit) when its
 * runs change length more than PP_MAX_DELTA_SEGMENTS times. */
PP_HIDDEN int32_t pp_delta_plan_make(pp_delta_plan *plan, const pp_batch *b);

/* A hash of a plan's segments: equal for steps whose delta-rule nodes have equal shapes. */
PP_HIDDEN uint64_t pp_delta_plan_shape(const pp_delta_plan *plan);

/* Whether a pool of c lives on the model's device (else in host memory). */
static inline int pp_pool_on_device(const pp_kv_cache *c, const struct ggml_tensor *pool) {
    return c->device_buffer != NULL && !ggml_backend_buffer_is_host(pool->buffer);
}

#define PP_ATTN_MAX_ROWS  32   /* query rows of one tile: tokens x group heads */
#define PP_ATTN_KEY_CHUNK 32   /* keys converted and scored together */

struct pp_attention_math;

/* Per-thread working memory of the paged-attention kernel, made with the
 * context (or harness) so that a step never allocates: n_threads slices of
 * floats_per_thread floats, plus the math variant this CPU runs. */
typedef struct pp_attention_scratch {
    float  *data;
    size_t  floats_per_thread;
    int32_t n_threads;
    const struct pp_attention_math *math;
} pp_attention_scratch;

/* (Re)size s for n_threads threads and head_dim; on failure
 * PP_ERR_NO_MEMORY and s is unchanged. Release with pp_attention_scratch_release. */
int32_t pp_attention_scratch_init(pp_attention_scratch *s, int32_t head_dim, int32_t n_threads);
void pp_attention_scratch_release(pp_attention_scratch *s);

/* What the paged-attention operator of one layer needs besides its tensors.
 * Points at the step's host-side batch, valid while the graph computes. */
/* model/attention_graph.c: how a step's sequence runs go through GGML's flash
 * attention on a paged cache. Runs with the same number of queries form a
 * group, one flash-attention call per layer. Arrays are the context's, sized
 * for max_batch_tokens (+1 for group_first). */
#define PP_FLASH_KV_BUCKET 64    /* keys gathered per run are padded to a multiple of at least this */
typedef struct pp_flash_plan {
    int32_t  n_runs;
    int32_t  n_groups;
    int32_t  in_order;      /* the groups' runs, concatenated, are the batch's token order */
    int32_t *run_t0;        /* [n_runs] first token of each run, in batch order */
    int32_t *run_nq;        /* [n_runs] its queries */
    int32_t *order;         /* [n_runs] the runs by group, each group's in batch order */
    int32_t *group_first;   /* [n_groups + 1] each group's first entry of order */
    int32_t *group_nq;      /* [n_groups] queries per run */
    int32_t *group_kv;      /* [2 n_groups] keys gathered per run: full layers, windowed layers */
} pp_flash_plan;

typedef struct pp_attention_params {
    const pp_batch *batch;
    const pp_flash_plan *plan;   /* this step's, for GGML's flash attention on pages */
    const float *sinks;          /* [n_head] attention sinks for our kernel (host memory), or NULL */
    struct ggml_tensor *sinks_tensor;   /* the same as a tensor, for GGML's flash attention, or NULL */
    const pp_attention_scratch *scratch;   /* sized for the context's threads */
    int32_t block_size;
    int32_t window;        /* 0: full causal attention */
    int32_t group;         /* the layer's group: which block tables and slots it uses */
    float   scale;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    atomic_int slices_done;   /* split-K: threads through this step's slices (reset each step) */
    struct pp_lora_plan *lora;   /* the step's LoRA adapters (model/lora.h), or NULL: none */
} pp_attention_params;

/* Keys of one softmax slice, at absolute positions: the unit split-K hands to a thread, and
 * the order every attention row is summed in (a multiple of PP_ATTN_KEY_CHUNK). */
#define PP_ATTN_SLICE_KEYS 256

/* The CPU paged-attention operator (ggml_custom_4d callback).
 * dst: [head_dim, n_head, n_tokens] f32; src[0] q with the same shape;
 * src[1], src[2]: the layer's K and V pools after this step's writes. */
void pp_paged_attention_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata);

/* Split-K variant for fewer work items than threads: slices of each key
 * range, merged by log-sum-exp by the last thread to finish its slices (see
 * kernels/paged_attention.c). dst: the output's [head_dim, n_head, n_tokens]
 * f32 values, then the slices' partial results; a view gives the output. */
void pp_paged_attention_split_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata);

/* How many key slices the layer's attention of this step is split into (1: none). */
int pp_paged_attention_splits(const pp_attention_params *ap, int n_threads);

/* The paged attention of one layer as one custom op (split-K when there are
 * fewer work items than threads and the key ranges are long enough).
 * Returns [head_dim, n_head, n_tokens] f32. */
struct ggml_tensor *pp_paged_attention(struct ggml_context *ctx, struct ggml_tensor *q,
                                       struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                       pp_attention_params *ap, int n_threads);

int32_t pp_check_batch(const pp_model *model, const pp_kv_cache *cache, const pp_batch *batch);

/* Token i's sequence index is in range, its sequence's tokens are contiguous
 * and their positions increase: what the kernel's query tiles rely on. */
int32_t pp_check_token_order(const pp_batch *batch, int i);

/* Build the forward graph of one step. Inputs are created with
 * ggml_set_input and named "tokens", "positions", "slots", "logit_rows" (hybrids also
 * "mrope_positions", I32 [4 n_tokens] for IMRoPE, and "state_slots", I32 [n_runs]; rs gives
 * their state pool and plan, NULL for other models),
 * and, where GGML's flash attention runs (slabs, or paged with gather set),
 * the inputs pp_fill_flash_inputs fills (masks, gathered key slots); the output is named
 * "logits". gather: paged attention as GGML ops (pages gathered by slot, then
 * flash attention) instead of our CPU operator; layers whose pools are on
 * a device take that path whatever gather says. */
struct ggml_cgraph *pp_build_graph(struct ggml_context *ctx, const pp_model *model,
                                   const pp_kv_cache *cache, const pp_batch *batch,
                                   pp_attention_params *layer_params, struct pp_panel_gemm_state *gemm_states,
                                   int n_threads, int gather, size_t max_nodes, const pp_recurrent_step *rs);

/* A 1-d input tensor of a step's graph, named for its upload. */
static inline struct ggml_tensor *pp_graph_input(struct ggml_context *ctx, enum ggml_type type, int64_t n,
                                                 const char *name) {
    struct ggml_tensor *t = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

/* graph.c: w x as every weight product of a decoder graph runs it on the CPU (columns padded so
 * a column's result does not depend on how many share the product; docs/batch-invariance.md). */
struct ggml_tensor *pp_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x);

/* The quantized columns of the last input a panel GEMM read: projections of one input (q,
 * k and v; gate and up) share one quantize op. */
typedef struct pp_panel_columns {
    const struct ggml_tensor *x;
    struct ggml_tensor *cols;
} pp_panel_columns;

/* model/graph.c: w x through the weight's panels when it has them (state non-NULL with a
 * packed weight), else GGML's product. Returns [w->ne[1], x->ne[1]] f32. */
PP_HIDDEN struct ggml_tensor *pp_graph_project(struct ggml_context *ctx, struct ggml_tensor *w,
                                               struct pp_panel_gemm_state *state, struct ggml_tensor *x,
                                               pp_panel_columns *last);

/* model/graph.c: a SwiGLU FFN (gate, up, down: the states at gs[gate], gs[gate + 1],
 * gs[gate + 2] when gs is non-NULL) on cur. */
PP_HIDDEN struct ggml_tensor *pp_graph_swiglu_ffn(struct ggml_context *ctx, enum pp_arch arch,
                                                  struct ggml_tensor *gate, struct ggml_tensor *up,
                                                  struct ggml_tensor *down, struct pp_panel_gemm_state *gs,
                                                  struct ggml_tensor *cur, pp_panel_columns *last);

/* model/delta_net_graph.c: Gated DeltaNet layer il on cur [n_embd, n_tokens] (after its
 * attn_norm): projections, the short convolution and the delta rule per segment of the plan
 * from the states of its runs' slots (state_slots: I32 [n_runs], in run order), those slots'
 * states after the step written back into the pool (nodes added to gf), the gated norm and
 * the output projection. rows: the token rows wanted (NULL: all). Returns [n_embd, rows] f32. */
struct ggml_tensor *pp_build_delta_net(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_model *m, int il,
                                       const pp_recurrent_step *rs, struct ggml_tensor *state_slots,
                                       struct pp_panel_gemm_state *gemm_states, struct ggml_tensor *cur,
                                       struct ggml_tensor *rows, pp_panel_columns *last);

/* model/moe_graph.c: qwen35moe's shared expert on cur: its SwiGLU scaled by
 * sigmoid(ffn_gate_inp_shexp . cur) per token. */
struct ggml_tensor *pp_build_shared_expert(struct ggml_context *ctx, const pp_layer *L,
                                           struct pp_panel_gemm_state *gemm_states, struct ggml_tensor *cur,
                                           pp_panel_columns *last);

/* model/moe_graph.c: the routed experts' FFN of layer L on cur [n_embd, n_tokens]
 * (after ffn_norm): each token's n_expert_used most probable experts, their
 * SwiGLU outputs summed with the router's probabilities renormalised over
 * them. gemm_states: the layer's PP_N_PROJ panel slots (their GATE, UP and
 * DOWN hold the expert panels, if packed), or NULL. Returns [n_embd,
 * n_tokens] f32. Call only for layers with experts. */
struct ggml_tensor *pp_build_moe_ffn(struct ggml_context *ctx, const pp_model_hparams *hp, const pp_layer *L,
                                     struct pp_panel_gemm_state *gemm_states, struct ggml_tensor *cur);

/* model/moe_graph.c: gpt-oss's routed experts on cur [n_embd, n_tokens] (after
 * its post_attention_norm): each token's n_expert_used highest router logits
 * (bias added), softmaxed among themselves, weight those experts' outputs,
 * each expert with its gate/up/down biases and the clamped SwiGLU.
 * gemm_states as for pp_build_moe_ffn. Returns [n_embd, n_tokens] f32. Call
 * only for PP_ARCH_GPT_OSS layers. */
struct ggml_tensor *pp_build_gpt_oss_moe_ffn(struct ggml_context *ctx, const pp_model_hparams *hp,
                                             const pp_layer *L, struct pp_panel_gemm_state *gemm_states,
                                             struct ggml_tensor *cur);

/* model/attention_graph.c: first key position the gathered path reads for a
 * run whose first query is at p0. */
int pp_gather_first_key(int p0, int window);

/* GGML's flash attention of the batch's queries q [head_dim, n_head, n_tokens]
 * over a layer's pools (slabs, or pages gathered by slot); returns
 * [head_dim, n_head, n_tokens] f32. Its inputs are filled by pp_fill_flash_inputs. */
struct ggml_tensor *pp_flash_attention(struct ggml_context *ctx, const pp_kv_cache *cache,
                                       const pp_batch *batch, struct ggml_tensor *q,
                                       struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                       const pp_attention_params *ap);

/* Group the batch's runs (see pp_flash_plan); swa_window: the model's window. */
void pp_flash_plan_make(pp_flash_plan *plan, const pp_batch *b, int swa_window);

/* A hash of what the plan's graph shapes depend on: equal for steps whose
 * flash-attention nodes have equal shapes. */
uint64_t pp_flash_plan_shape(const pp_flash_plan *plan);

/* The step's masks, gathered key slots and row orders into the graph's host input tensors. */
void pp_fill_flash_inputs(struct ggml_cgraph *gf, const pp_batch *b, const pp_flash_plan *plan, int swa_window,
                          const pp_kv_cache *cache);

#define PP_MAX_GRAPH_NODES 8192
/* Where GGML's flash attention runs, each run of a sequence's tokens (slabs)
 * or each group of runs (pages) adds its own nodes to every layer (query
 * view and permute, K and V and their views, the attention, the concat): at
 * most this many. */
#define PP_GRAPH_NODES_PER_RUN 12

/* Nodes a decoding graph may need: the fixed part, plus per layer one set
 * per sequence run, up to one run per token of the largest batch. */
static inline size_t pp_graph_capacity(int n_layer, int max_batch_tokens) {
    return PP_MAX_GRAPH_NODES + (size_t)n_layer * (size_t)max_batch_tokens * PP_GRAPH_NODES_PER_RUN;
}

/* Nodes a Gated DeltaNet layer adds per segment of the plan (views, the state reads and
 * writes, the convolution, the norms, the delta rule, the concat of the outputs). */
#define PP_DELTA_NODES_PER_SEGMENT 40

/* model/context.c: frees a compute context's allocator, backend and thread pool
 * (each may be NULL). A forked child must not join its parent's workers, so
 * a pool made by another process than pool_pid's is left alone. */
void pp_compute_release(ggml_gallocr_t galloc, ggml_backend_t backend, ggml_threadpool_t threadpool,
                        pid_t pool_pid);

/* model/context.c: the graph the context's last step ran (NULL when none is
 * kept) and its scheduler (NULL for a model on the CPU alone); borrowed, for
 * introspection only (testing/graph_export.c). */
struct ggml_cgraph *pp_context_last_graph(const pp_context *c);
ggml_backend_sched_t pp_context_scheduler(const pp_context *c);

/* model/encoder_graph.c: the bert forward over n_seqs inputs padded to max_len
 * tokens each. Inputs "tokens", "types", "positions" ([n_seqs * max_len]
 * i32) and "kq_mask" ([max_len, max_len, 1, n_seqs] f32); output "hidden"
 * [n_embd, n_seqs * max_len]. */
struct ggml_cgraph *pp_build_encoder_graph(struct ggml_context *ctx, const pp_model *m, int n_seqs,
                                           int max_len);

#endif
