/* A hybrid's Gated DeltaNet layer as GGML ops (llama.cpp's qwen35 semantics, see
 * pyllama_paged/testing/reference/hybrid_model.py): the step's tokens go through the input
 * projections together; then each segment of consecutive sequence runs of one length reads
 * its runs' convolution and delta-rule states from the state pool by slot (ggml_get_rows),
 * runs ggml_ssm_conv and ggml_gated_delta_net over its tokens, and writes the states after
 * its last tokens back by slot (ggml_set_rows) in the same graph; the outputs, back in batch
 * order, get the gated RMS norm and the output projection together. A decode step's
 * single-token sequences are one segment, a prefill chunk its own. */
#include "common/engine_internal.h"
#include "panels/panels.h"

#include <math.h>

int32_t pp_delta_plan_make(pp_delta_plan *plan, const pp_batch *b) {
    plan->n_runs = 0;
    plan->n_segments = 0;
    for (int t0 = 0; t0 < b->n_tokens;) {
        int t1 = t0 + 1;
        while (t1 < b->n_tokens && b->seq_index[t1] == b->seq_index[t0]) t1++;
        const int32_t len = t1 - t0;
        const int32_t s = plan->n_segments;
        if (s > 0 && plan->seg_tokens[s - 1] == len) {
            plan->seg_runs[s - 1]++;
        } else {
            if (s == PP_MAX_DELTA_SEGMENTS)
                return pp_fail(PP_ERR_INVALID, "a hybrid model's step changes sequence length more than %d times "
                               "between runs: order its sequences by length or split the step",
                               PP_MAX_DELTA_SEGMENTS);
            plan->seg_tokens[s] = len;
            plan->seg_runs[s] = 1;
            plan->n_segments++;
        }
        plan->n_runs++;
        t0 = t1;
    }
    return PP_OK;
}

uint64_t pp_delta_plan_shape(const pp_delta_plan *plan) {
    uint64_t h = 1469598103934665603ull;
    for (int s = 0; s < plan->n_segments; s++) {
        h = (h ^ (uint64_t)plan->seg_tokens[s]) * 1099511628211ull;
        h = (h ^ (uint64_t)plan->seg_runs[s]) * 1099511628211ull;
    }
    return h;
}

/* llama.cpp's L2 norm of q and k over each head's S values: x / sqrt(sum(x^2) + eps),
 * as an RMS norm with eps / S, scaled by 1 / sqrt(S). */
static struct ggml_tensor *l2_norm(struct ggml_context *ctx, struct ggml_tensor *x, float eps) {
    const float n = (float)x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / sqrtf(n));
}

/* The per-token inputs of the layer's delta rule, computed for the whole step. */
typedef struct delta_inputs {
    struct ggml_tensor *qkv;    /* [channels, n_tokens]: the convolution's input */
    struct ggml_tensor *gate;   /* [H_v, n_tokens]: log-decay g */
    struct ggml_tensor *beta;   /* [H_v, n_tokens]: write strength */
} delta_inputs;

/* One segment: runs [run0, run0 + n) of T tokens each, from token t0. Returns its outputs
 * [S H_v, T n] and adds its state writes to gf. */
static struct ggml_tensor *segment(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_model *m, int il,
                                   const pp_state_pool *pool, const delta_inputs *in, struct ggml_tensor *state_slots,
                                   int64_t t0, int64_t run0, int64_t T, int64_t n) {
    const pp_model_hparams *hp = &m->hp;
    const pp_layer *L = &m->layers[il];
    const int64_t S = hp->ssm_d_state, H_k = hp->ssm_n_group, H_v = hp->ssm_dt_rank;
    const int64_t C = pp_conv_channels(hp), K1 = hp->ssm_d_conv - 1, key_dim = H_k * S;
    const size_t f = sizeof(float);
    struct ggml_tensor *slots = ggml_view_1d(ctx, state_slots, n, (size_t)run0 * state_slots->nb[0]);

    /* the convolution over its carried inputs and these tokens' */
    struct ggml_tensor *conv_state = ggml_reshape_3d(ctx, ggml_get_rows(ctx, pool->conv[il], slots), K1, C, n);
    struct ggml_tensor *x = ggml_view_3d(ctx, in->qkv, C, T, n, in->qkv->nb[1], T * in->qkv->nb[1],
                                         (size_t)t0 * in->qkv->nb[1]);
    struct ggml_tensor *conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, x), 0);   /* [K1 + T, C, n] */
    struct ggml_tensor *conv_last = ggml_view_3d(ctx, conv_in, K1, C, n, conv_in->nb[1], conv_in->nb[2], (size_t)T * f);
    conv_last = ggml_reshape_2d(ctx, ggml_cont(ctx, conv_last), K1 * C, n);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, pool->conv[il], conv_last, slots));
    struct ggml_tensor *conv = ggml_silu(ctx, ggml_ssm_conv(ctx, conv_in, L->ssm_conv1d));   /* [C, T, n] */

    /* q, k (L2-normed), v: views of the convolution's channels */
    struct ggml_tensor *q = ggml_view_4d(ctx, conv, S, H_k, T, n, S * f, conv->nb[1], conv->nb[2], 0);
    struct ggml_tensor *k = ggml_view_4d(ctx, conv, S, H_k, T, n, S * f, conv->nb[1], conv->nb[2], key_dim * f);
    struct ggml_tensor *v = ggml_view_4d(ctx, conv, S, H_v, T, n, S * f, conv->nb[1], conv->nb[2], 2 * key_dim * f);
    q = l2_norm(ctx, q, hp->rms_eps);
    k = l2_norm(ctx, k, hp->rms_eps);
    struct ggml_tensor *g = ggml_view_4d(ctx, in->gate, 1, H_v, T, n, f, in->gate->nb[1], T * in->gate->nb[1],
                                         (size_t)t0 * in->gate->nb[1]);
    struct ggml_tensor *beta = ggml_view_4d(ctx, in->beta, 1, H_v, T, n, f, in->beta->nb[1], T * in->beta->nb[1],
                                            (size_t)t0 * in->beta->nb[1]);

    /* the delta rule from the runs' states; the states after their last tokens go back */
    struct ggml_tensor *state = ggml_reshape_4d(ctx, ggml_get_rows(ctx, pool->delta[il], slots), S, S, H_v, n);
    struct ggml_tensor *out = ggml_gated_delta_net(ctx, q, k, v, g, beta, state, 1);   /* [S H_v, T n + S n] */
    struct ggml_tensor *new_state = ggml_view_2d(ctx, out, S * S * H_v, n, S * S * H_v * f, (size_t)(T * n) * out->nb[1]);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, pool->delta[il], new_state, slots));
    return ggml_view_2d(ctx, out, S * H_v, T * n, out->nb[1], 0);
}

struct ggml_tensor *pp_build_delta_net(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_model *m, int il,
                                       const pp_recurrent_step *rs, struct ggml_tensor *state_slots,
                                       struct pp_panel_gemm_state *gemm_states, struct ggml_tensor *cur,
                                       struct ggml_tensor *rows, pp_panel_columns *last) {
    const pp_model_hparams *hp = &m->hp;
    const pp_layer *L = &m->layers[il];
    const int64_t S = hp->ssm_d_state, H_v = hp->ssm_dt_rank, n_tokens = cur->ne[1];
#define PROJECT(w, p, x) pp_graph_project(ctx, (w), gemm_states ? &gemm_states[(p)] : NULL, (x), last)
    delta_inputs in;
    in.qkv = PROJECT(L->ssm_in, PP_PROJ_SSM_IN, cur);
    struct ggml_tensor *z = PROJECT(L->ssm_gate, PP_PROJ_SSM_GATE, cur);   /* [H_v S, n_tokens] */
    in.beta = ggml_sigmoid(ctx, PROJECT(L->ssm_beta, PP_PROJ_SSM_BETA, cur));
    struct ggml_tensor *alpha = ggml_add(ctx, PROJECT(L->ssm_alpha, PP_PROJ_SSM_ALPHA, cur), L->ssm_dt_b);
    in.gate = ggml_mul(ctx, ggml_softplus(ctx, alpha), L->ssm_a);   /* softplus(alpha + dt) * -exp(A_log) */

    struct ggml_tensor *o = NULL;
    int64_t t0 = 0, run0 = 0;
    for (int s = 0; s < rs->plan->n_segments; s++) {
        const int64_t T = rs->plan->seg_tokens[s], n = rs->plan->seg_runs[s];
        struct ggml_tensor *part = segment(ctx, gf, m, il, rs->pool, &in, state_slots, t0, run0, T, n);
        o = o ? ggml_concat(ctx, o, part, 1) : part;
        t0 += T * n;
        run0 += n;
    }
    if (o->nb[1] != o->ne[0] * sizeof(float) || !ggml_is_contiguous(o)) o = ggml_cont(ctx, o);
    if (rows) {   /* the last layer: only the rows asked for go on */
        o = ggml_get_rows(ctx, o, rows);
        z = ggml_get_rows(ctx, z, rows);
    }
    const int64_t n_out = rows ? rows->ne[0] : n_tokens;
    /* the gated norm over each value head: rms_norm(o) * ssm_norm * silu(z) */
    o = ggml_mul(ctx, ggml_rms_norm(ctx, ggml_reshape_3d(ctx, o, S, H_v, n_out), hp->rms_eps), L->ssm_norm);
    o = ggml_mul(ctx, o, ggml_silu(ctx, ggml_reshape_3d(ctx, z, S, H_v, n_out)));
    struct ggml_tensor *y = PROJECT(L->ssm_out, PP_PROJ_SSM_OUT, ggml_reshape_2d(ctx, o, S * H_v, n_out));
#undef PROJECT
    return y;
}
