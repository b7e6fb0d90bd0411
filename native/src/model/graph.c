/* The forward graph of one step for the supported architectures: plain
 * GGML ops for everything but attention, which is our paged operator (paged
 * caches on the CPU), GGML's flash attention over a sequence's contiguous
 * slab (the paged=False baseline), or the portable paged path: each
 * sequence's pages gathered by slot with ggml_get_rows, then GGML's flash
 * attention, so paging works on any backend GGML has. */
#include "common/engine_internal.h"
#include "panels/panels.h"

#include <math.h>
#include <stdio.h>

static struct ggml_tensor *norm(struct ggml_context *ctx, struct ggml_tensor *x,
                                struct ggml_tensor *weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

static struct ggml_tensor *input(struct ggml_context *ctx, enum ggml_type type, int64_t n,
                                 const char *name) {
    struct ggml_tensor *t = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

/* The keys a run of one sequence's queries (positions p0..) reads in the
 * gathered path: from the first key of p0's window. */
int pp_gather_first_key(int p0, int window) {
    return window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
}

/* Rows [head_dim, n_kv, n_head_kv] of one sequence's keys (or values): a view
 * of its slab, or its pages' rows gathered by slot ("kv_idx.<t0>.<group>.<windowed>",
 * filled per step, shared by the group's layers). */
static struct ggml_tensor *sequence_rows(struct ggml_context *ctx, const pp_kv_cache *cache,
                                         const pp_batch *batch, struct ggml_tensor *pool,
                                         const pp_attention_params *ap, int t0, int n_kv) {
    if (!cache->paged) {
        const int s = batch->seq_index[t0];
        const int64_t slab = batch->block_tables[(size_t)s * batch->max_blocks_per_seq];
        return ggml_view_3d(ctx, pool, ap->head_dim, n_kv, ap->n_head_kv, pool->nb[1],
                            ggml_row_size(cache->type, ap->head_dim),
                            (size_t)slab * cache->block_size * pool->nb[1]);
    }
    char name[48];
    snprintf(name, sizeof name, "kv_idx.%d.%d.%d", t0, ap->group, ap->window > 0);
    struct ggml_tensor *idx = ggml_get_tensor(ctx, name);
    if (!idx) idx = input(ctx, GGML_TYPE_I32, n_kv, name);
    struct ggml_tensor *rows = ggml_get_rows(ctx, pool, idx);   /* [n_embd_kv, n_kv] f32 */
    return ggml_view_3d(ctx, rows, ap->head_dim, n_kv, ap->n_head_kv, rows->nb[1],
                        ggml_row_size(rows->type, ap->head_dim), 0);
}

/* GGML flash attention of each sequence's queries over its keys: its slab
 * (paged=False) or its gathered pages (the portable paged path). */
static struct ggml_tensor *flash_attention(struct ggml_context *ctx, const pp_kv_cache *cache,
                                           const pp_batch *batch, struct ggml_tensor *q,
                                           struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                           const pp_attention_params *ap) {
    struct ggml_tensor *out = NULL;
    for (int t0 = 0; t0 < batch->n_tokens;) {
        const int s = batch->seq_index[t0];
        int t1 = t0;
        while (t1 < batch->n_tokens && batch->seq_index[t1] == s) t1++;
        const int n_q = t1 - t0;
        /* A slab is read from its start; gathered pages from the first query's window. */
        const int k_lo = cache->paged ? pp_gather_first_key(batch->positions[t0], ap->window) : 0;
        const int n_kv = batch->positions[t1 - 1] + 1 - k_lo;
        struct ggml_tensor *qs = ggml_view_3d(ctx, q, ap->head_dim, ap->n_head, n_q, q->nb[1],
                                              q->nb[2], (size_t)t0 * q->nb[2]);
        qs = ggml_permute(ctx, qs, 0, 2, 1, 3);  /* [head_dim, n_q, n_head] */
        struct ggml_tensor *ks = sequence_rows(ctx, cache, batch, k_pool, ap, t0, n_kv);
        struct ggml_tensor *vs = sequence_rows(ctx, cache, batch, v_pool, ap, t0, n_kv);
        /* Layers share masks: one per sequence run and window kind. */
        char name[32];
        snprintf(name, sizeof name, "mask.%d.%d", t0, ap->window > 0);
        struct ggml_tensor *mask = ggml_get_tensor(ctx, name);
        if (!mask) {
            mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);
            ggml_set_name(mask, name);
            ggml_set_input(mask);
        }
        struct ggml_tensor *o = ggml_flash_attn_ext(ctx, qs, ks, vs, mask, ap->scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
        out = out ? ggml_concat(ctx, out, o, 2) : o;  /* [head_dim, n_head, tokens] */
        t0 = t1;
    }
    return out;
}

/* GGML's CPU matrix products (tinyBLAS, the repacked Q4_K GEMM) work on
 * columns in fours, and a product over a few columns that are not a multiple
 * of 4 takes slower paths for the rest. A product over 3 < n < 16 columns is
 * computed over n rounded up to 4 (zero columns), keeping the first n.
 * Measured on the default model, 2 threads, one decode step of n sequences
 * (bench: padded vs not, same run): n=5 48.1 -> 43.8 ms, n=7 55.6 -> 44.7,
 * n=11 68.8 -> 58.6, n=15 80.9 -> 76.4; from 17 on it gains nothing (and
 * costs up to 6%), and at n <= 3 it costs more than it saves. */
#define PP_MATMUL_COLUMNS 4
#define PP_MATMUL_PAD_MAX 16

int32_t pp_matmul_columns(int32_t n) {
    if (n <= 3 || n >= PP_MATMUL_PAD_MAX) return n;
    return (n + PP_MATMUL_COLUMNS - 1) / PP_MATMUL_COLUMNS * PP_MATMUL_COLUMNS;
}

static struct ggml_tensor *matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
    const int64_t n = x->ne[1];
    const int64_t pad = pp_matmul_columns((int32_t)n) - n;
    if (pad == 0 || x->ne[2] != 1 || x->ne[3] != 1) return ggml_mul_mat(ctx, w, x);
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, ggml_pad(ctx, x, 0, (int)pad, 0, 0));
    return ggml_view_2d(ctx, y, y->ne[0], n, y->nb[1], 0);
}

/* The quantized columns of the last input a panel GEMM read: q, k and v
 * (gate and up) share one quantize op. */
typedef struct panel_columns {
    const struct ggml_tensor *x;
    struct ggml_tensor *cols;
} panel_columns;

/* w x through the weight's panels when it has them (state non-NULL), else GGML's product. */
static struct ggml_tensor *project(struct ggml_context *ctx, struct ggml_tensor *w, pp_panel_gemm_state *state,
                                   struct ggml_tensor *x, panel_columns *last) {
    if (!state || !state->w) return matmul(ctx, w, x);
    /* float panels multiply the f32 columns themselves */
    if (pp_panel_type_is_float(state->w->type))
        return pp_panel_gemm(ctx, state, x->nb[0] == sizeof(float) ? x : ggml_cont(ctx, x));
    if (last->x != x) {
        last->cols = pp_panel_quantize(ctx, x, state->kernel);
        last->x = x;
    }
    return pp_panel_gemm(ctx, state, last->cols);
}

struct ggml_cgraph *pp_build_graph(struct ggml_context *ctx, const pp_model *m,
                                   const pp_kv_cache *cache, const pp_batch *batch,
                                   pp_attention_params *layer_params, pp_panel_gemm_state *gemm_states,
                                   int n_threads, int gather, size_t max_nodes) {
    const pp_model_hparams *hp = &m->hp;
    const int n_tokens = batch->n_tokens;
    const int head_dim = hp->head_dim;
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, max_nodes, false);

    struct ggml_tensor *tokens = input(ctx, GGML_TYPE_I32, n_tokens, "tokens");
    struct ggml_tensor *positions = input(ctx, GGML_TYPE_I32, n_tokens, "positions");
    /* One run of slots per layer group (see pp_batch). */
    struct ggml_tensor *slots = input(ctx, GGML_TYPE_I64, (int64_t)n_tokens * cache->n_groups, "slots");
    /* logit rows, then hidden rows (embeddings): the rows the last layer computes */
    struct ggml_tensor *logit_rows = input(ctx, GGML_TYPE_I32, batch->n_logits + batch->n_hidden, "logit_rows");

    pp_panel_gemm_state *head = gemm_states ? &gemm_states[hp->n_layer * PP_N_PROJ] : NULL;
    panel_columns last = {0};
    /* A tied head packed into panels is the embedding too: its rows are read from there. */
    struct ggml_tensor *x = head && head->w && !m->output ? pp_panel_embed(ctx, head->w, tokens)
                                                          : ggml_get_rows(ctx, m->tok_embd, tokens);
    if (hp->embd_scale != 1.0f) x = ggml_scale(ctx, x, hp->embd_scale);

    for (int il = 0; il < hp->n_layer; il++) {
        const pp_layer *L = &m->layers[il];
        pp_attention_params *ap = &layer_params[il];
        pp_panel_gemm_state *gs = gemm_states ? &gemm_states[il * PP_N_PROJ] : NULL;
#define PROJECT(w, p, x) project(ctx, (w), gs ? &gs[(p)] : NULL, (x), &last)
        struct ggml_tensor *cur = norm(ctx, x, L->attn_norm, hp->rms_eps);

        struct ggml_tensor *q = PROJECT(L->wq, PP_PROJ_Q, cur);
        struct ggml_tensor *k = PROJECT(L->wk, PP_PROJ_K, cur);
        struct ggml_tensor *v = PROJECT(L->wv, PP_PROJ_V, cur);
        if (L->bq) q = ggml_add(ctx, q, L->bq);
        if (L->bk) k = ggml_add(ctx, k, L->bk);
        if (L->bv) v = ggml_add(ctx, v, L->bv);
        q = ggml_reshape_3d(ctx, q, head_dim, hp->n_head, n_tokens);
        k = ggml_reshape_3d(ctx, k, head_dim, hp->n_head_kv, n_tokens);
        if (L->q_norm) q = norm(ctx, q, L->q_norm, hp->rms_eps);
        if (L->k_norm) k = norm(ctx, k, L->k_norm, hp->rms_eps);
        const float base = m->layer_window[il] > 0 ? hp->rope_freq_base_swa : hp->rope_freq_base;
        const float freq_scale = m->layer_window[il] > 0 ? 1.0f : hp->rope_freq_scale;
        q = ggml_rope_ext(ctx, q, positions, m->rope_freqs, hp->n_rot, hp->rope_type, hp->n_ctx_train,
                          base, freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
        k = ggml_rope_ext(ctx, k, positions, m->rope_freqs, hp->n_rot, hp->rope_type, hp->n_ctx_train,
                          base, freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);

        /* Write this step's K/V rows to their slots before attention reads them. */
        struct ggml_tensor *k_rows = ggml_reshape_2d(ctx, k, head_dim * hp->n_head_kv, n_tokens);
        struct ggml_tensor *v_rows = ggml_reshape_2d(ctx, ggml_cont(ctx, v), head_dim * hp->n_head_kv,
                                                     n_tokens);
        struct ggml_tensor *layer_slots = ggml_view_1d(ctx, slots, n_tokens,
                                                       (size_t)ap->group * n_tokens * slots->nb[0]);
        struct ggml_tensor *k_pool = ggml_set_rows(ctx, cache->k[il], k_rows, layer_slots);
        struct ggml_tensor *v_pool = ggml_set_rows(ctx, cache->v[il], v_rows, layer_slots);
        ggml_build_forward_expand(gf, k_pool);
        ggml_build_forward_expand(gf, v_pool);

        struct ggml_tensor *attn;
        /* Our operator reads host pools; a pool on a device takes the gather path there. */
        if (cache->paged && !gather && !pp_pool_on_device(cache, cache->k[il])) {
            attn = pp_paged_attention(ctx, q, k_pool, v_pool, ap, n_threads);
        } else {
            attn = flash_attention(ctx, cache, batch, q, k_pool, v_pool, ap);
        }
        attn = ggml_reshape_2d(ctx, attn, head_dim * hp->n_head, n_tokens);
        if (il == hp->n_layer - 1) {
            /* After the last attention only the rows whose logits were asked
             * for matter: the rest of the layer and the output head run on
             * those alone. */
            attn = ggml_get_rows(ctx, attn, logit_rows);
            x = ggml_get_rows(ctx, x, logit_rows);
        }
        cur = PROJECT(L->wo, PP_PROJ_O, attn);
        if (L->post_attn_norm) cur = norm(ctx, cur, L->post_attn_norm, hp->rms_eps);
        x = ggml_add(ctx, cur, x);

        cur = norm(ctx, x, L->ffn_norm, hp->rms_eps);
        struct ggml_tensor *gate = PROJECT(L->ffn_gate, PP_PROJ_GATE, cur);
        struct ggml_tensor *up = PROJECT(L->ffn_up, PP_PROJ_UP, cur);
        cur = hp->arch == PP_ARCH_GEMMA3 ? ggml_geglu_split(ctx, gate, up) : ggml_swiglu_split(ctx, gate, up);
        cur = PROJECT(L->ffn_down, PP_PROJ_DOWN, cur);
        if (L->post_ffw_norm) cur = norm(ctx, cur, L->post_ffw_norm, hp->rms_eps);
        x = ggml_add(ctx, cur, x);
#undef PROJECT
    }

    x = norm(ctx, x, m->output_norm, hp->rms_eps);
    if (batch->n_hidden > 0) {
        ggml_set_output(x);   /* the allocator keeps the rows the hidden view reads */
        struct ggml_tensor *hidden = ggml_view_2d(ctx, x, hp->n_embd, batch->n_hidden, x->nb[1],
                                                  (size_t)batch->n_logits * x->nb[1]);
        ggml_set_name(hidden, "hidden");
        ggml_set_output(hidden);
        ggml_build_forward_expand(gf, hidden);
        if (batch->n_logits == 0) return gf;
        x = ggml_view_2d(ctx, x, hp->n_embd, batch->n_logits, x->nb[1], 0);
    }
    struct ggml_tensor *logits = project(ctx, m->output ? m->output : m->tok_embd, head, x, &last);
    if (hp->final_logit_softcap > 0.0f) {
        logits = ggml_scale(ctx, logits, 1.0f / hp->final_logit_softcap);
        logits = ggml_tanh(ctx, logits);
        logits = ggml_scale(ctx, logits, hp->final_logit_softcap);
    }
    ggml_set_name(logits, "logits");
    ggml_set_output(logits);
    ggml_build_forward_expand(gf, logits);
    return gf;
}
