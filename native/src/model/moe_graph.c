/* The routed experts' feed-forward block (qwen3moe, qwen35moe) as GGML ops: a router
 * picks each token's experts, ggml_mul_mat_id (or, for experts packed into
 * panels, pp_expert_matmul) runs every token through the
 * matrices of its own experts, and the outputs are summed with the router's
 * weights. The semantics are llama.cpp's for this architecture: softmax over
 * all experts, the n_expert_used most probable kept, their probabilities
 * renormalised to sum to 1. */
#include "common/engine_internal.h"
#include "model/graph_ops.h"
#include "panels/panels.h"

#include <math.h>

/* The smallest positive f16 normal: llama.cpp's floor for the sum of the
 * kept probabilities, which a softmax never gets near. */
#define PP_MOE_MIN_WEIGHT_SUM 6.103515625e-5f

struct ggml_tensor *pp_build_moe_ffn(struct ggml_context *ctx, const pp_model_hparams *hp, const pp_layer *L,
                                     struct pp_panel_gemm_state *gemm_states, struct ggml_tensor *cur) {
    const int64_t n_embd = cur->ne[0], n_tokens = cur->ne[1];
    const int64_t n_used = hp->n_expert_used;

    struct ggml_tensor *weights;
    struct ggml_tensor *selected = pp_moe_softmax_route(ctx, pp_matmul(ctx, L->ffn_gate_inp, cur), (int)n_used,
                                                        &weights);

    /* one input column per token, broadcast over its n_used experts */
    struct ggml_tensor *x = ggml_reshape_3d(ctx, cur, n_embd, 1, n_tokens);
    /* the experts' panels where they were packed (gemm_states: the layer's slots), else ggml_mul_mat_id */
    pp_expert_route route = {.selected = selected};
#define EXPERTS(w, p, x) pp_expert_matmul(ctx, &route, (w), gemm_states ? &gemm_states[(p)] : NULL, (x))
    struct ggml_tensor *gate = EXPERTS(L->ffn_gate_exps, PP_PROJ_GATE, x);   /* [n_ff_exp, n_used, n_tokens] */
    struct ggml_tensor *up = EXPERTS(L->ffn_up_exps, PP_PROJ_UP, x);
    struct ggml_tensor *h = ggml_swiglu_split(ctx, gate, up);
    struct ggml_tensor *experts = EXPERTS(L->ffn_down_exps, PP_PROJ_DOWN, h);   /* [n_embd, n_used, n_tokens] */
#undef EXPERTS
    return pp_moe_weighted_sum(ctx, experts, weights);
}

struct ggml_tensor *pp_moe_softmax_route(struct ggml_context *ctx, struct ggml_tensor *logits, int n_used,
                                         struct ggml_tensor **weights) {
    const int64_t n_expert = logits->ne[0], n_tokens = logits->ne[1];
    struct ggml_tensor *probs = ggml_soft_max(ctx, logits);   /* [n_expert, n_tokens] */
    /* I32 [n_used, n_tokens], each token's experts by falling probability */
    struct ggml_tensor *selected = ggml_argsort_top_k(ctx, probs, n_used);
    struct ggml_tensor *w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, n_expert, n_tokens), selected);
    w = ggml_reshape_2d(ctx, w, n_used, n_tokens);
    struct ggml_tensor *weight_sum = ggml_clamp(ctx, ggml_sum_rows(ctx, w), PP_MOE_MIN_WEIGHT_SUM, INFINITY);
    *weights = ggml_reshape_3d(ctx, ggml_div(ctx, w, weight_sum), 1, n_used, n_tokens);
    return selected;
}

struct ggml_tensor *pp_moe_weighted_sum(struct ggml_context *ctx, struct ggml_tensor *experts,
                                        struct ggml_tensor *weights) {
    const int64_t n_embd = experts->ne[0], n_used = experts->ne[1], n_tokens = experts->ne[2];
    experts = ggml_mul(ctx, experts, weights);
    /* The sum over a token's experts, as adds of strided views: a reduction
     * along the middle axis would need a transposed copy first. */
    struct ggml_tensor *out = ggml_view_2d(ctx, experts, n_embd, n_tokens, experts->nb[2], 0);
    for (int64_t i = 1; i < n_used; i++)
        out = ggml_add(ctx, out, ggml_view_2d(ctx, experts, n_embd, n_tokens, experts->nb[2], i * experts->nb[1]));
    /* a single expert's view is strided: the residual add wants it contiguous */
    return n_used == 1 ? ggml_cont(ctx, out) : out;
}

/* ---- gpt-oss ------------------------------------------------------------
 * llama.cpp's openai-moe semantics: the router's logits get their bias, the
 * n_expert_used highest are kept and softmaxed among themselves (not over
 * all experts), every expert matrix has a bias row of its own (added with
 * ggml_add_id, which picks each token's experts' rows), and the activation
 * is the clamped SwiGLU with gpt-oss's constants. */

#define PP_GPT_OSS_SWIGLU_ALPHA 1.702f   /* the sigmoid's slope in x * sigmoid(alpha x) */
#define PP_GPT_OSS_SWIGLU_LIMIT 7.0f     /* gate clamped above, up clamped both ways */

struct ggml_tensor *pp_build_gpt_oss_moe_ffn(struct ggml_context *ctx, const pp_model_hparams *hp,
                                             const pp_layer *L, struct pp_panel_gemm_state *gemm_states,
                                             struct ggml_tensor *cur) {
    const int64_t n_embd = cur->ne[0], n_tokens = cur->ne[1];
    const int64_t n_expert = hp->n_expert, n_used = hp->n_expert_used;

    struct ggml_tensor *logits = ggml_add(ctx, pp_matmul(ctx, L->ffn_gate_inp, cur), L->ffn_gate_inp_b);
    struct ggml_tensor *selected = ggml_argsort_top_k(ctx, logits, (int)n_used);   /* I32 [n_used, n_tokens] */
    struct ggml_tensor *weights = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, n_expert, n_tokens), selected);
    weights = ggml_soft_max(ctx, ggml_reshape_2d(ctx, weights, n_used, n_tokens));
    weights = ggml_reshape_3d(ctx, weights, 1, n_used, n_tokens);

    struct ggml_tensor *x = ggml_reshape_3d(ctx, cur, n_embd, 1, n_tokens);
    /* as in pp_build_moe_ffn: the experts' panels where they were packed (MXFP4 ones in MXFP4 panels) */
    pp_expert_route route = {.selected = selected};
#define EXPERTS(w, p, x) pp_expert_matmul(ctx, &route, (w), gemm_states ? &gemm_states[(p)] : NULL, (x))
    struct ggml_tensor *gate = EXPERTS(L->ffn_gate_exps, PP_PROJ_GATE, x);   /* [n_ff_exp, n_used, n_tokens] */
    gate = ggml_add_id(ctx, gate, L->ffn_gate_exps_b, selected);
    struct ggml_tensor *up = EXPERTS(L->ffn_up_exps, PP_PROJ_UP, x);
    up = ggml_add_id(ctx, up, L->ffn_up_exps_b, selected);
    struct ggml_tensor *h = ggml_swiglu_oai(ctx, gate, up, PP_GPT_OSS_SWIGLU_ALPHA, PP_GPT_OSS_SWIGLU_LIMIT);
    struct ggml_tensor *experts = EXPERTS(L->ffn_down_exps, PP_PROJ_DOWN, h);   /* [n_embd, n_used, n_tokens] */
#undef EXPERTS
    experts = ggml_add_id(ctx, experts, L->ffn_down_exps_b, selected);
    return pp_moe_weighted_sum(ctx, experts, weights);
}

/* ---- qwen35moe's shared expert --------------------------------------------
 * llama.cpp's qwen35moe graph: a SwiGLU FFN beside the routed experts, run by every token,
 * scaled per token by the sigmoid of one more router row (ffn_gate_inp_shexp, 1-D). */

struct ggml_tensor *pp_build_shared_expert(struct ggml_context *ctx, const pp_layer *L,
                                           struct pp_panel_gemm_state *gemm_states, struct ggml_tensor *cur,
                                           pp_panel_columns *last) {
    struct ggml_tensor *y = pp_graph_swiglu_ffn(ctx, PP_ARCH_QWEN35MOE, L->ffn_gate_shexp, L->ffn_up_shexp,
                                                L->ffn_down_shexp,
                                                gemm_states ? &gemm_states[PP_PROJ_SHEXP_GATE] : NULL, cur, last);
    struct ggml_tensor *gate = ggml_sigmoid(ctx, pp_matmul(ctx, L->ffn_gate_inp_shexp, cur));   /* [1, n_tokens] */
    return ggml_mul(ctx, y, gate);
}
