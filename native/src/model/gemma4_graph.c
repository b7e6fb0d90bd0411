/* Gemma 4's step graph (llama.cpp's gemma4 graph, src/models/gemma4.cpp):
 * gemma3's layer with each layer's own head size, KV heads and rope (the full
 * layers' proportional rope through rope_freqs), an unweighted RMSNorm of v (k
 * standing in for a missing v), attention scale 1, layers that read an earlier
 * layer's K/V pools instead of writing their own, the per-layer embeddings
 * (E2B/E4B), an output scale per layer, and in the MoE models routed experts
 * beside the dense FFN. The pieces every decoder shares are graph_ops.h's. */
#include "common/engine_internal.h"
#include "model/graph_ops.h"
#include "panels/panels.h"

#include <math.h>

/* The per-layer embeddings' inputs of every layer at once [n_pl, n_tokens, n_layer] (llama.cpp's
 * build_inp_per_layer and project_per_layer_inputs): the token's row of per_layer_token_embd
 * times sqrt(n_pl), plus the RMS-normed projection of the scaled embedding x, over sqrt(2). */
static struct ggml_tensor *per_layer_inputs(struct ggml_context *ctx, const pp_model *m, struct ggml_tensor *tokens,
                                            struct ggml_tensor *x) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_pl = hp->n_embd_per_layer, n_tokens = tokens->ne[0];
    struct ggml_tensor *rows = ggml_get_rows(ctx, m->per_layer_tok_embd, tokens);   /* [n_pl * n_layer, n_tokens] */
    rows = ggml_scale(ctx, ggml_reshape_3d(ctx, rows, n_pl, hp->n_layer, n_tokens), sqrtf((float)n_pl));
    struct ggml_tensor *proj = pp_matmul(ctx, m->per_layer_model_proj, x);
    proj = ggml_scale(ctx, ggml_reshape_3d(ctx, proj, n_pl, hp->n_layer, n_tokens), 1.0f / sqrtf((float)hp->n_embd));
    proj = pp_graph_norm(ctx, proj, m->per_layer_proj_norm, hp->rms_eps);
    struct ggml_tensor *inputs = ggml_scale(ctx, ggml_add(ctx, proj, rows), 1.0f / sqrtf(2.0f));
    return ggml_cont(ctx, ggml_permute(ctx, inputs, 0, 2, 1, 3));
}

/* What layer il's per-layer input adds to the residual stream x (its rows' inputs: input). */
static struct ggml_tensor *per_layer_embedding(struct ggml_context *ctx, const pp_model *m, const pp_layer *L,
                                               struct ggml_tensor *x, struct ggml_tensor *input,
                                               pp_panel_columns *last) {
    struct ggml_tensor *gate = ggml_gelu(ctx, pp_graph_project(ctx, L->per_layer_inp_gate, NULL, x, last));
    struct ggml_tensor *y = pp_graph_project(ctx, L->per_layer_proj, NULL, ggml_mul(ctx, gate, input), last);
    return pp_graph_norm(ctx, y, L->per_layer_post_norm, m->hp.rms_eps);
}

/* Queries or keys [head_dim, heads, n_tokens]: their norm, then the layer's rope. */
static struct ggml_tensor *normed_rope(struct ggml_context *ctx, const pp_model *m, int il, struct ggml_tensor *x,
                                       struct ggml_tensor *norm, struct ggml_tensor *positions) {
    const pp_model_hparams *hp = &m->hp;
    const int sliding = m->layer_window[il] > 0;
    x = pp_graph_norm(ctx, x, norm, hp->rms_eps);
    return ggml_rope_ext(ctx, x, positions, sliding ? NULL : m->rope_freqs, pp_layer_n_rot(m, il), hp->rope_type,
                         hp->n_ctx_orig_yarn, sliding ? hp->rope_freq_base_swa : hp->rope_freq_base,
                         sliding ? hp->rope_freq_scale_swa : hp->rope_freq_scale, 0.0f, hp->yarn_attn_factor,
                         hp->yarn_beta_fast, hp->yarn_beta_slow);
}

/* The step's state a layer reads and adds to. */
typedef struct gemma4_step {
    struct ggml_cgraph *gf;
    const pp_kv_cache *cache;
    const pp_batch *batch;
    pp_graph_inputs in;
    pp_attention_params *layer_params;
    pp_panel_gemm_state *gemm_states;
    struct ggml_tensor *(*pools)[2];   /* [n_layer]: each layer's K and V pools after this step's writes */
    struct ggml_tensor *per_layer;     /* the per-layer embeddings' inputs, or NULL */
    pp_panel_columns last;
    int n_threads, gather;
} gemma4_step;

/* Layer il's attention of its normed input cur -> [head_dim x n_head, n_tokens]. */
static struct ggml_tensor *attention(struct ggml_context *ctx, const pp_model *m, gemma4_step *s, int il,
                                     struct ggml_tensor *cur) {
    const pp_layer *L = &m->layers[il];
    pp_panel_gemm_state *gs = s->gemm_states ? &s->gemm_states[il * PP_N_PROJ] : NULL;
    const int64_t hd = pp_layer_head_dim(m, il), n_head = m->hp.n_head, n_tokens = cur->ne[1];
    struct ggml_tensor *q = pp_graph_project(ctx, L->wq, gs ? &gs[PP_PROJ_Q] : NULL, cur, &s->last);
    q = normed_rope(ctx, m, il, ggml_reshape_3d(ctx, q, hd, n_head, n_tokens), L->q_norm, s->in.positions);
    const int src = pp_layer_kv_source(m, il);
    if (src == il) {
        const int64_t n_kv = pp_layer_n_head_kv(m, il);
        struct ggml_tensor *k = pp_graph_project(ctx, L->wk, gs ? &gs[PP_PROJ_K] : NULL, cur, &s->last);
        /* without a V projection, the keys' projection (before their norm) is V */
        struct ggml_tensor *v = L->wv ? pp_graph_project(ctx, L->wv, gs ? &gs[PP_PROJ_V] : NULL, cur, &s->last) : k;
        k = normed_rope(ctx, m, il, ggml_reshape_3d(ctx, k, hd, n_kv, n_tokens), L->k_norm, s->in.positions);
        v = ggml_rms_norm(ctx, ggml_reshape_3d(ctx, v, hd, n_kv, n_tokens), m->hp.rms_eps);
        pp_graph_write_kv(ctx, s->gf, s->cache, il, &s->layer_params[il], s->in.slots, k, v, s->pools[il]);
    } else {
        /* the source's pools as written this step: attention runs after those writes */
        s->pools[il][0] = s->pools[src][0];
        s->pools[il][1] = s->pools[src][1];
    }
    struct ggml_tensor *attn = pp_graph_attention(ctx, s->cache, s->batch, il, q, s->pools[il], &s->layer_params[il],
                                                  s->n_threads, s->gather);
    return ggml_reshape_2d(ctx, attn, hd * n_head, n_tokens);
}

/* The FFN of h (the residual after attention), before post_ffw_norm: the dense one, and where the
 * layer has experts the two side by side, each through its own output norm. */
static struct ggml_tensor *feed_forward(struct ggml_context *ctx, const pp_model *m, gemma4_step *s, int il,
                                        struct ggml_tensor *h) {
    const pp_layer *L = &m->layers[il];
    const float eps = m->hp.rms_eps;
    pp_panel_gemm_state *gs = s->gemm_states ? &s->gemm_states[il * PP_N_PROJ] : NULL;
    /* no adapters: pp_lora_create refuses gemma4 */
    struct ggml_tensor *dense = pp_graph_dense_ffn(ctx, m->hp.arch, L, gs, NULL, il,
                                                   pp_graph_norm(ctx, h, L->ffn_norm, eps), &s->last);
    if (!L->ffn_gate_inp) return dense;
    struct ggml_tensor *experts = pp_build_gemma4_moe_ffn(ctx, &m->hp, L, gs, pp_graph_norm(ctx, h, L->ffn_pre_norm_2, eps), h);
    return ggml_add(ctx, pp_graph_norm(ctx, dense, L->ffn_post_norm_1, eps),
                    pp_graph_norm(ctx, experts, L->ffn_post_norm_2, eps));
}

static struct ggml_tensor *layer(struct ggml_context *ctx, const pp_model *m, gemma4_step *s, int il,
                                 struct ggml_tensor *x) {
    const pp_layer *L = &m->layers[il];
    const float eps = m->hp.rms_eps;
    pp_panel_gemm_state *gs = s->gemm_states ? &s->gemm_states[il * PP_N_PROJ] : NULL;
    struct ggml_tensor *attn = attention(ctx, m, s, il, pp_graph_norm(ctx, x, L->attn_norm, eps));
    struct ggml_tensor *input = NULL;
    if (s->per_layer)
        input = ggml_view_2d(ctx, s->per_layer, s->per_layer->ne[0], s->per_layer->ne[1], s->per_layer->nb[1],
                             (size_t)il * s->per_layer->nb[2]);
    if (il == m->hp.n_layer - 1) {
        /* after the last attention only the rows asked for (see pp_build_graph) */
        attn = ggml_get_rows(ctx, attn, s->in.rows);
        x = ggml_get_rows(ctx, x, s->in.rows);
        if (input) input = ggml_get_rows(ctx, input, s->in.rows);
    }
    struct ggml_tensor *o = pp_graph_project(ctx, L->wo, gs ? &gs[PP_PROJ_O] : NULL, attn, &s->last);
    struct ggml_tensor *h = ggml_add(ctx, pp_graph_norm(ctx, o, L->post_attn_norm, eps), x);
    x = ggml_add(ctx, pp_graph_norm(ctx, feed_forward(ctx, m, s, il, h), L->post_ffw_norm, eps), h);
    if (input) x = ggml_add(ctx, x, per_layer_embedding(ctx, m, L, x, input, &s->last));
    return L->out_scale ? ggml_mul(ctx, x, L->out_scale) : x;
}

struct ggml_cgraph *pp_build_gemma4_graph(struct ggml_context *ctx, const pp_model *m, const pp_kv_cache *cache,
                                          const pp_batch *batch, pp_attention_params *layer_params,
                                          pp_panel_gemm_state *gemm_states, int n_threads, int gather,
                                          size_t max_nodes) {
    struct ggml_tensor *pools[512][2];   /* n_layer <= 512 (pp_model_create) */
    gemma4_step s = {.gf = ggml_new_graph_custom(ctx, max_nodes, false), .cache = cache, .batch = batch,
                     .layer_params = layer_params, .gemm_states = gemm_states, .pools = pools,
                     .n_threads = n_threads, .gather = gather};
    struct ggml_tensor *x = pp_graph_embed(ctx, m, cache, batch, gemm_states, &s.in);
    if (m->per_layer_tok_embd) s.per_layer = per_layer_inputs(ctx, m, s.in.tokens, x);
    for (int il = 0; il < m->hp.n_layer; il++) x = layer(ctx, m, &s, il, x);
    pp_panel_gemm_state *head = gemm_states ? &gemm_states[m->hp.n_layer * PP_N_PROJ] : NULL;
    return pp_graph_output(ctx, s.gf, m, batch, x, head, &s.last);
}

struct ggml_tensor *pp_build_gemma4_moe_ffn(struct ggml_context *ctx, const pp_model_hparams *hp,
                                            const pp_layer *L, pp_panel_gemm_state *gs, struct ggml_tensor *moe_in,
                                            struct ggml_tensor *h) {
    const int64_t n_embd = moe_in->ne[0], n_tokens = moe_in->ne[1], n_expert = hp->n_expert;
    /* the router reads rmsnorm(h) / sqrt(n_embd) times its scale, not the experts' input */
    struct ggml_tensor *router_in = ggml_scale(ctx, ggml_rms_norm(ctx, h, hp->rms_eps), 1.0f / sqrtf((float)n_embd));
    router_in = ggml_mul(ctx, router_in, L->ffn_gate_inp_s);
    struct ggml_tensor *weights;
    struct ggml_tensor *selected = pp_moe_softmax_route(ctx, pp_matmul(ctx, L->ffn_gate_inp, router_in),
                                                        hp->n_expert_used, &weights);
    /* each expert's output scale folds into its weight: the sum is linear in them */
    if (L->ffn_down_exps_s) {   /* picked per token as the router's probabilities are */
        struct ggml_tensor *scales = ggml_repeat_4d(ctx, ggml_reshape_3d(ctx, L->ffn_down_exps_s, 1, n_expert, 1), 1,
                                                    n_expert, n_tokens, 1);
        weights = ggml_mul(ctx, weights, ggml_get_rows(ctx, scales, selected));
    }
    struct ggml_tensor *x = ggml_reshape_3d(ctx, moe_in, n_embd, 1, n_tokens);
    pp_expert_route route = {.selected = selected};
#define EXPERTS(w, p, x) pp_expert_matmul(ctx, &route, (w), gs ? &gs[(p)] : NULL, (x))
    struct ggml_tensor *gate, *up;
    if (L->ffn_gate_up_exps) {   /* gate rows, then up rows */
        struct ggml_tensor *gu = EXPERTS(L->ffn_gate_up_exps, PP_PROJ_GATE, x);   /* [2 n_ff_exp, n_used, n_tokens] */
        const int64_t n_ff = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], (size_t)n_ff * gu->nb[0]);
    } else {
        gate = EXPERTS(L->ffn_gate_exps, PP_PROJ_GATE, x);
        up = EXPERTS(L->ffn_up_exps, PP_PROJ_UP, x);
    }
    struct ggml_tensor *experts = EXPERTS(L->ffn_down_exps, PP_PROJ_DOWN, ggml_geglu_split(ctx, gate, up));
#undef EXPERTS
    return pp_moe_weighted_sum(ctx, experts, weights);
}
