/* The forward graph of an encoder-only model (bert): every input attends to
 * all of its own tokens (no causal mask, no KV cache). Inputs are laid out
 * padded, n_seqs blocks of max_len token rows, so attention is one batched
 * matrix product per layer; a mask hides each input's padding keys. The
 * caller sorts inputs by length so that padding stays small. */
#include "common/engine_internal.h"

#include <math.h>

static struct ggml_tensor *layer_norm(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *w,
                                      struct ggml_tensor *b, float eps) {
    return ggml_add(ctx, ggml_mul(ctx, ggml_norm(ctx, x, eps), w), b);
}

static struct ggml_tensor *input(struct ggml_context *ctx, enum ggml_type type, int64_t n, const char *name) {
    struct ggml_tensor *t = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

/* Bidirectional multi-head attention over the padded layout.
 * x: [n_embd, max_len * n_seqs]; returns the same shape (before wo). */
static struct ggml_tensor *attention(struct ggml_context *ctx, const pp_model *m, const pp_layer *L,
                                     struct ggml_tensor *x, struct ggml_tensor *mask, int n_seqs, int max_len) {
    const int hd = m->hp.head_dim, nh = m->hp.n_head;
    struct ggml_tensor *q = ggml_add(ctx, ggml_mul_mat(ctx, L->wq, x), L->bq);
    struct ggml_tensor *k = ggml_add(ctx, ggml_mul_mat(ctx, L->wk, x), L->bk);
    struct ggml_tensor *v = ggml_add(ctx, ggml_mul_mat(ctx, L->wv, x), L->bv);
    /* [hd, nh, len, seqs] -> q, k: [hd, len, nh, seqs]; v: [len, hd, nh, seqs] */
    q = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, q, hd, nh, max_len, n_seqs), 0, 2, 1, 3));
    k = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, k, hd, nh, max_len, n_seqs), 0, 2, 1, 3));
    v = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, v, hd, nh, max_len, n_seqs), 1, 2, 0, 3));
    struct ggml_tensor *kq = ggml_mul_mat(ctx, k, q);                    /* [len_k, len_q, nh, seqs] */
    kq = ggml_soft_max_ext(ctx, kq, mask, m->hp.attn_scale, 0.0f);
    struct ggml_tensor *out = ggml_mul_mat(ctx, v, kq);                  /* [hd, len_q, nh, seqs] */
    out = ggml_cont(ctx, ggml_permute(ctx, out, 0, 2, 1, 3));            /* [hd, nh, len_q, seqs] */
    return ggml_reshape_2d(ctx, out, (int64_t)hd * nh, (int64_t)max_len * n_seqs);
}

struct ggml_cgraph *pp_build_encoder_graph(struct ggml_context *ctx, const pp_model *m, int n_seqs, int max_len) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_rows = (int64_t)n_seqs * max_len;
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, PP_MAX_GRAPH_NODES, false);

    struct ggml_tensor *tokens = input(ctx, GGML_TYPE_I32, n_rows, "tokens");
    struct ggml_tensor *types = input(ctx, GGML_TYPE_I32, n_rows, "types");
    struct ggml_tensor *positions = input(ctx, GGML_TYPE_I32, n_rows, "positions");
    struct ggml_tensor *mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, max_len, max_len, 1, n_seqs);
    ggml_set_name(mask, "kq_mask");
    ggml_set_input(mask);

    struct ggml_tensor *x = ggml_get_rows(ctx, m->tok_embd, tokens);
    if (m->tok_types) x = ggml_add(ctx, x, ggml_get_rows(ctx, m->tok_types, types));
    x = ggml_add(ctx, x, ggml_get_rows(ctx, m->pos_embd, positions));
    x = layer_norm(ctx, x, m->embd_norm, m->embd_norm_b, hp->rms_eps);

    for (int il = 0; il < hp->n_layer; il++) {
        const pp_layer *L = &m->layers[il];
        /* post-norm blocks: x = norm(x + attention(x)); x = norm(x + ffn(x)) */
        struct ggml_tensor *cur = attention(ctx, m, L, x, mask, n_seqs, max_len);
        cur = ggml_add(ctx, ggml_mul_mat(ctx, L->wo, cur), L->bo);
        x = layer_norm(ctx, ggml_add(ctx, cur, x), L->attn_out_norm, L->attn_out_norm_b, hp->rms_eps);
        cur = ggml_add(ctx, ggml_mul_mat(ctx, L->ffn_up, x), L->ffn_up_b);
        cur = ggml_gelu(ctx, cur);   /* tanh form, as llama.cpp runs BERT: a table lookup, where erf cost 14% */
        cur = ggml_add(ctx, ggml_mul_mat(ctx, L->ffn_down, cur), L->ffn_down_b);
        x = layer_norm(ctx, ggml_add(ctx, cur, x), L->layer_out_norm, L->layer_out_norm_b, hp->rms_eps);
    }
    ggml_set_name(x, "hidden");
    ggml_set_output(x);
    ggml_build_forward_expand(gf, x);
    return gf;
}
