/* The forward graph of one step for the supported architectures: plain
 * GGML ops for everything but attention, which is our paged operator (paged
 * caches on the CPU) or GGML's flash attention (attention_graph.c). */
#include "common/engine_internal.h"
#include "model/graph_ops.h"
#include "panels/panels.h"
#include "model/lora.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>

static struct ggml_tensor *norm(struct ggml_context *ctx, struct ggml_tensor *x,
                                struct ggml_tensor *weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
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

/* GGML's CPU product runs a single column through its row-by-column dot
 * kernels and two or more through tinyBLAS, whose sums are ordered
 * otherwise; for the types tinyBLAS takes, one column is computed as two
 * (a zero one), so a sequence's values do not depend on whether it decodes
 * alone (docs/batch-invariance.md). */
static int single_column_pads(const struct ggml_tensor *w) {
    static int llamafile = -1;
    if (llamafile < 0) llamafile = ggml_cpu_has_llamafile();
    if (!llamafile) return 0;
    switch (w->type) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_IQ4_NL:
            return 1;
        default:
            return 0;
    }
}

static struct ggml_tensor *matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
    const int64_t n = x->ne[1];
    const int64_t pad = n == 1 && single_column_pads(w) ? 1 : pp_matmul_columns((int32_t)n) - n;
    /* a device's products gain nothing from it, and its decode graphs keep one shape */
    const int on_device = w->buffer && !ggml_backend_buffer_is_host(w->buffer);
    if (pad == 0 || on_device || x->ne[2] != 1 || x->ne[3] != 1) return ggml_mul_mat(ctx, w, x);
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, ggml_pad(ctx, x, 0, (int)pad, 0, 0));
    return ggml_view_2d(ctx, y, y->ne[0], n, y->nb[1], 0);
}

struct ggml_tensor *pp_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
    return matmul(ctx, w, x);
}

/* x as a panel product reads it: float panels the f32 columns themselves,
 * quantized ones its quantized columns (one op per x). */
static struct ggml_tensor *panel_input(struct ggml_context *ctx, const pp_panel_gemm_state *state,
                                       struct ggml_tensor *x, pp_panel_columns *last) {
    if (pp_panel_type_is_float(state->w->type)) return x->nb[0] == sizeof(float) ? x : ggml_cont(ctx, x);
    if (last->x != x) {
        last->cols = pp_panel_quantize(ctx, x, state->kernel);
        last->x = x;
    }
    return last->cols;
}

struct ggml_tensor *pp_graph_project(struct ggml_context *ctx, struct ggml_tensor *w, pp_panel_gemm_state *state,
                                     struct ggml_tensor *x, pp_panel_columns *last) {
    if (!state || !state->w) return matmul(ctx, w, x);
    return pp_panel_gemm(ctx, state, panel_input(ctx, state, x, last));
}

/* GGML splits the gated activation's rows among the threads, so a decode
 * step's single row (n_ff values) ran on one thread while the others waited
 * at the next barrier: GELU's tanh made that 5% of a 270M model's step. The
 * product is elementwise over contiguous gate and up, so it runs on rows of
 * PP_GLU_ROW values instead and is viewed back. */
#define PP_GLU_ROW 128
/* pp_panel_gated takes gate's and up's states as a pair, and pp_graph_swiglu_ffn the down's after them */
_Static_assert(PP_PROJ_UP == PP_PROJ_GATE + 1 && PP_PROJ_DOWN == PP_PROJ_UP + 1, "gate, up, down states adjacent");
_Static_assert(PP_PROJ_SHEXP_UP == PP_PROJ_SHEXP_GATE + 1 && PP_PROJ_SHEXP_DOWN == PP_PROJ_SHEXP_UP + 1,
               "the shared expert's gate, up, down states adjacent");
_Static_assert(PP_PROJ_BESIDE_UP == PP_PROJ_BESIDE_GATE + 1 && PP_PROJ_BESIDE_DOWN == PP_PROJ_BESIDE_UP + 1,
               "a dense FFN's beside experts gate, up, down states adjacent");

/* Whether an architecture's dense FFN is GELU-gated (else SiLU-gated). */
static int gelu_gated(enum pp_arch arch) { return arch == PP_ARCH_GEMMA3 || arch == PP_ARCH_GEMMA4; }

static struct ggml_tensor *gated_activation(struct ggml_context *ctx, enum pp_arch arch, struct ggml_tensor *gate,
                                            struct ggml_tensor *up) {
    const int64_t n_ff = gate->ne[0], n_tokens = gate->ne[1];
    const int split = n_ff % PP_GLU_ROW == 0 && ggml_is_contiguous(gate) && ggml_is_contiguous(up);
    if (split) {
        gate = ggml_reshape_2d(ctx, gate, PP_GLU_ROW, n_ff / PP_GLU_ROW * n_tokens);
        up = ggml_reshape_2d(ctx, up, PP_GLU_ROW, n_ff / PP_GLU_ROW * n_tokens);
    }
    struct ggml_tensor *y = gelu_gated(arch) ? ggml_geglu_split(ctx, gate, up) : ggml_swiglu_split(ctx, gate, up);
    return split ? ggml_reshape_2d(ctx, y, n_ff, n_tokens) : y;
}

/* A gated FFN (GELU for the gemmas, else SiLU) with the step's LoRA adapters of layer il added to its products (lora NULL:
 * none); a fused panel product cannot take an adapter's addition, so an adapted gate or up
 * runs apart. */
static struct ggml_tensor *adapted_swiglu_ffn(struct ggml_context *ctx, enum pp_arch arch, struct ggml_tensor *gate,
                                              struct ggml_tensor *up, struct ggml_tensor *down,
                                              pp_panel_gemm_state *gs, struct ggml_tensor *cur,
                                              pp_panel_columns *last, struct pp_lora_plan *lora, int il) {
#define PROJECT(w, i, p, x) pp_lora_project(ctx, lora, il, (p), (x), pp_graph_project(ctx, (w), gs ? gs + (i) : NULL, (x), last))
    if (gs && pp_panel_gated_takes(gs) && !pp_lora_touches_gated(lora, il)) {
        cur = pp_panel_gated(ctx, gs, panel_input(ctx, gs, cur, last), gelu_gated(arch));
    } else {
        struct ggml_tensor *g = PROJECT(gate, 0, PP_PROJ_GATE, cur);
        struct ggml_tensor *u = PROJECT(up, 1, PP_PROJ_UP, cur);
        cur = gated_activation(ctx, arch, g, u);
    }
    return PROJECT(down, 2, PP_PROJ_DOWN, cur);
#undef PROJECT
}

struct ggml_tensor *pp_graph_swiglu_ffn(struct ggml_context *ctx, enum pp_arch arch, struct ggml_tensor *gate,
                                        struct ggml_tensor *up, struct ggml_tensor *down, pp_panel_gemm_state *gs,
                                        struct ggml_tensor *cur, pp_panel_columns *last) {
    return adapted_swiglu_ffn(ctx, arch, gate, up, down, gs, cur, last, NULL, 0);
}

struct ggml_tensor *pp_graph_dense_ffn(struct ggml_context *ctx, enum pp_arch arch, const pp_layer *L,
                                       pp_panel_gemm_state *gs, struct pp_lora_plan *lora, int il,
                                       struct ggml_tensor *cur, pp_panel_columns *last) {
    return adapted_swiglu_ffn(ctx, arch, L->ffn_gate, L->ffn_up, L->ffn_down, gs ? &gs[pp_dense_ffn_slot(L)] : NULL,
                              cur, last, lora, il);
}

struct ggml_tensor *pp_graph_norm(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *weight,
                                  float eps) {
    return norm(ctx, x, weight, eps);
}

/* Layer il's attention of cur [n_embd, n_tokens] (after attn_norm), K/V written to its pools:
 * [head_dim n_head, n_tokens] f32, before the output projection. A hybrid's query projection
 * holds each head's query then its output gate: the attention is scaled by sigmoid(gate). */
static struct ggml_tensor *attention(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_model *m,
                                     const pp_kv_cache *cache, const pp_batch *batch, pp_attention_params *ap,
                                     pp_panel_gemm_state *gs, const pp_graph_inputs *in, int il, struct ggml_tensor *cur,
                                     int n_threads, int gather, pp_panel_columns *last) {
    const pp_model_hparams *hp = &m->hp;
    const pp_layer *L = &m->layers[il];
    const int n_tokens = batch->n_tokens, head_dim = hp->head_dim, gated = m->n_recurrent > 0;
#define PROJECT(w, p, x) pp_lora_project(ctx, ap->lora, il, (p), (x), pp_graph_project(ctx, (w), gs ? &gs[(p)] : NULL, (x), last))
    struct ggml_tensor *q = PROJECT(L->wq, PP_PROJ_Q, cur);
    struct ggml_tensor *k = PROJECT(L->wk, PP_PROJ_K, cur);
    struct ggml_tensor *v = PROJECT(L->wv, PP_PROJ_V, cur);
#undef PROJECT
    if (L->bq) q = ggml_add(ctx, q, L->bq);
    if (L->bk) k = ggml_add(ctx, k, L->bk);
    if (L->bv) v = ggml_add(ctx, v, L->bv);
    struct ggml_tensor *gate = NULL;
    if (gated) {
        const size_t f = ggml_element_size(q);
        gate = ggml_cont_2d(ctx, ggml_view_3d(ctx, q, head_dim, hp->n_head, n_tokens, 2 * head_dim * f, q->nb[1],
                                              head_dim * f), head_dim * hp->n_head, n_tokens);
        q = ggml_view_3d(ctx, q, head_dim, hp->n_head, n_tokens, 2 * head_dim * f, q->nb[1], 0);
    } else {
        q = ggml_reshape_3d(ctx, q, head_dim, hp->n_head, n_tokens);
    }
    k = ggml_reshape_3d(ctx, k, head_dim, hp->n_head_kv, n_tokens);
    if (L->q_norm) q = norm(ctx, q, L->q_norm, hp->rms_eps);
    if (L->k_norm) k = norm(ctx, k, L->k_norm, hp->rms_eps);
    const float base = m->layer_window[il] > 0 ? hp->rope_freq_base_swa : hp->rope_freq_base;
    const float freq_scale = m->layer_window[il] > 0 ? hp->rope_freq_scale_swa : hp->rope_freq_scale;
    /* YaRN on an unscaled layer would be a no-op in GGML anyway */
    const float ext_factor = freq_scale != 1.0f ? hp->yarn_ext_factor : 0.0f;
    if (in->mrope_positions) {
        int sections[GGML_MROPE_SECTIONS];
        for (int i = 0; i < GGML_MROPE_SECTIONS; i++) sections[i] = hp->rope_sections[i];
        q = ggml_rope_multi(ctx, q, in->mrope_positions, NULL, hp->n_rot, sections, hp->rope_type, hp->n_ctx_orig_yarn,
                            base, freq_scale, ext_factor, hp->yarn_attn_factor, hp->yarn_beta_fast, hp->yarn_beta_slow);
        k = ggml_rope_multi(ctx, k, in->mrope_positions, NULL, hp->n_rot, sections, hp->rope_type, hp->n_ctx_orig_yarn,
                            base, freq_scale, ext_factor, hp->yarn_attn_factor, hp->yarn_beta_fast, hp->yarn_beta_slow);
    } else {
        q = ggml_rope_ext(ctx, q, in->positions, m->rope_freqs, hp->n_rot, hp->rope_type, hp->n_ctx_orig_yarn,
                          base, freq_scale, ext_factor, hp->yarn_attn_factor, hp->yarn_beta_fast, hp->yarn_beta_slow);
        k = ggml_rope_ext(ctx, k, in->positions, m->rope_freqs, hp->n_rot, hp->rope_type, hp->n_ctx_orig_yarn,
                          base, freq_scale, ext_factor, hp->yarn_attn_factor, hp->yarn_beta_fast, hp->yarn_beta_slow);
    }

    /* Write this step's K/V rows to their slots before attention reads them. */
    struct ggml_tensor *pools[2];
    pp_graph_write_kv(ctx, gf, cache, il, ap, in->slots, k, v, pools);
    struct ggml_tensor *attn = pp_graph_attention(ctx, cache, batch, il, q, pools, ap, n_threads, gather);
    attn = ggml_reshape_2d(ctx, attn, head_dim * hp->n_head, n_tokens);
    return gate ? ggml_mul(ctx, attn, ggml_sigmoid(ctx, gate)) : attn;
}

/* Layer il's feed-forward block on cur (after its FFN norm). */
static struct ggml_tensor *feed_forward(struct ggml_context *ctx, const pp_model *m, int il, pp_panel_gemm_state *gs,
                                        struct pp_lora_plan *lora, struct ggml_tensor *cur, pp_panel_columns *last) {
    const pp_model_hparams *hp = &m->hp;
    const pp_layer *L = &m->layers[il];
    if (hp->arch == PP_ARCH_GPT_OSS) return pp_build_gpt_oss_moe_ffn(ctx, hp, L, gs, cur);
    if (!L->ffn_gate_inp) return pp_graph_dense_ffn(ctx, hp->arch, L, gs, lora, il, cur, last);
    struct ggml_tensor *routed = pp_build_moe_ffn(ctx, hp, L, gs, cur);
    return L->ffn_gate_inp_shexp ? ggml_add(ctx, routed, pp_build_shared_expert(ctx, L, gs, cur, last)) : routed;
}

struct ggml_cgraph *pp_build_graph(struct ggml_context *ctx, const pp_model *m,
                                   const pp_kv_cache *cache, const pp_batch *batch,
                                   pp_attention_params *layer_params, pp_panel_gemm_state *gemm_states,
                                   int n_threads, int gather, size_t max_nodes, const pp_recurrent_step *rs) {
    if (m->hp.arch == PP_ARCH_GEMMA4)
        return pp_build_gemma4_graph(ctx, m, cache, batch, layer_params, gemm_states, n_threads, gather, max_nodes);
    const pp_model_hparams *hp = &m->hp;
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, max_nodes, false);
    pp_graph_inputs in = {0};
    struct ggml_tensor *x = pp_graph_embed(ctx, m, cache, batch, gemm_states, &in);
    if (rs) {
        in.mrope_positions = pp_graph_input(ctx, GGML_TYPE_I32, 4 * (int64_t)batch->n_tokens, "mrope_positions");
        in.state_slots = pp_graph_input(ctx, GGML_TYPE_I32, rs->plan->n_runs, "state_slots");
    }
    pp_panel_gemm_state *head = gemm_states ? &gemm_states[hp->n_layer * PP_N_PROJ] : NULL;
    pp_panel_columns last = {0};

    for (int il = 0; il < hp->n_layer; il++) {
        const pp_layer *L = &m->layers[il];
        pp_panel_gemm_state *gs = gemm_states ? &gemm_states[il * PP_N_PROJ] : NULL;
        /* After the last layer's mixer only the rows whose logits were asked for matter: the
         * rest of the layer and the output head run on those alone. */
        const int last_layer = il == hp->n_layer - 1;
        struct ggml_tensor *cur = norm(ctx, x, L->attn_norm, hp->rms_eps);
        if (m->layer_recurrent && m->layer_recurrent[il]) {
            cur = pp_build_delta_net(ctx, gf, m, il, rs, in.state_slots, gs, cur, last_layer ? in.rows : NULL, &last);
        } else {
            struct ggml_tensor *attn = attention(ctx, gf, m, cache, batch, &layer_params[il], gs, &in, il, cur,
                                                 n_threads, gather, &last);
            if (last_layer) attn = ggml_get_rows(ctx, attn, in.rows);
            cur = pp_lora_project(ctx, layer_params[il].lora, il, PP_PROJ_O, attn,
                                  pp_graph_project(ctx, L->wo, gs ? &gs[PP_PROJ_O] : NULL, attn, &last));
            if (L->bo) cur = ggml_add(ctx, cur, L->bo);
            if (L->post_attn_norm) cur = norm(ctx, cur, L->post_attn_norm, hp->rms_eps);
        }
        if (last_layer) x = ggml_get_rows(ctx, x, in.rows);
        x = ggml_add(ctx, cur, x);

        cur = feed_forward(ctx, m, il, gs, layer_params[il].lora, norm(ctx, x, L->ffn_norm, hp->rms_eps), &last);
        if (L->post_ffw_norm) cur = norm(ctx, cur, L->post_ffw_norm, hp->rms_eps);
        x = ggml_add(ctx, cur, x);
    }

    return pp_graph_output(ctx, gf, m, batch, x, head, &last);
}

/* ---- the building blocks other architectures' graphs share (graph_ops.h) ---- */

struct ggml_tensor *pp_graph_embed(struct ggml_context *ctx, const pp_model *m, const pp_kv_cache *cache,
                                   const pp_batch *batch, pp_panel_gemm_state *gemm_states, pp_graph_inputs *in) {
    const int n_tokens = batch->n_tokens;
    in->tokens = pp_graph_input(ctx, GGML_TYPE_I32, n_tokens, "tokens");
    in->positions = pp_graph_input(ctx, GGML_TYPE_I32, n_tokens, "positions");
    /* One run of slots per layer group (see pp_batch). */
    in->slots = pp_graph_input(ctx, GGML_TYPE_I64, (int64_t)n_tokens * cache->n_groups, "slots");
    /* logit rows, then hidden rows (embeddings): the rows the last layer computes */
    in->rows = pp_graph_input(ctx, GGML_TYPE_I32, batch->n_logits + batch->n_hidden, "logit_rows");
    const pp_panel_gemm_state *head = gemm_states ? &gemm_states[m->hp.n_layer * PP_N_PROJ] : NULL;
    /* A tied head packed into panels is the embedding too: its rows are read from there. */
    struct ggml_tensor *x = head && head->w && !m->output ? pp_panel_embed(ctx, head->w, in->tokens)
                                                          : ggml_get_rows(ctx, m->tok_embd, in->tokens);
    if (m->hp.embd_scale != 1.0f) x = ggml_scale(ctx, x, m->hp.embd_scale);
    if (batch->n_embd_rows > 0) {
        /* given embeddings (an image's rows) overwrite their rows' lookups, unscaled, as llama.cpp
         * feeds a Gemma 3 image */
        struct ggml_tensor *embd = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, m->hp.n_embd, batch->n_embd_rows);
        ggml_set_name(embd, "embd_in");
        ggml_set_input(embd);
        x = ggml_set_rows(ctx, x, embd, pp_graph_input(ctx, GGML_TYPE_I64, batch->n_embd_rows, "embd_rows"));
    }
    return x;
}

void pp_graph_write_kv(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_kv_cache *cache, int il,
                       const pp_attention_params *ap, struct ggml_tensor *slots, struct ggml_tensor *k,
                       struct ggml_tensor *v, struct ggml_tensor *pools[2]) {
    const int64_t n_tokens = k->ne[2], n_embd_kv = k->ne[0] * k->ne[1];
    struct ggml_tensor *layer_slots = ggml_view_1d(ctx, slots, n_tokens, (size_t)ap->group * n_tokens * slots->nb[0]);
    struct ggml_tensor *rows[2] = {ggml_reshape_2d(ctx, ggml_is_contiguous(k) ? k : ggml_cont(ctx, k), n_embd_kv, n_tokens),
                                   ggml_reshape_2d(ctx, ggml_is_contiguous(v) ? v : ggml_cont(ctx, v), n_embd_kv, n_tokens)};
    struct ggml_tensor *dst[2] = {cache->k[il], cache->v[il]};
    for (int i = 0; i < 2; i++) {
        pools[i] = ggml_set_rows(ctx, dst[i], rows[i], layer_slots);
        ggml_build_forward_expand(gf, pools[i]);
    }
}

struct ggml_tensor *pp_graph_attention(struct ggml_context *ctx, const pp_kv_cache *cache, const pp_batch *batch,
                                       int il, struct ggml_tensor *q, struct ggml_tensor *pools[2],
                                       pp_attention_params *ap, int n_threads, int gather) {
    /* Our operator reads host pools; a pool on a device takes the gather path there. */
    if (cache->paged && !gather && !pp_pool_on_device(cache, cache->k[il]))
        return pp_paged_attention(ctx, q, pools[0], pools[1], ap, n_threads);
    return pp_flash_attention(ctx, cache, batch, q, pools[0], pools[1], ap);
}

struct ggml_cgraph *pp_graph_output(struct ggml_context *ctx, struct ggml_cgraph *gf, const pp_model *m,
                                    const pp_batch *batch, struct ggml_tensor *x, pp_panel_gemm_state *head,
                                    pp_panel_columns *last) {
    const pp_model_hparams *hp = &m->hp;
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
    struct ggml_tensor *logits = pp_graph_project(ctx, m->output ? m->output : m->tok_embd, head, x, last);
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
