/* The tensors of an encoder-only (bert) model, by llama.cpp's GGUF names:
 * where each goes in pp_model and the shape the hyper-parameters give it.
 * model.c hands bert names here and keeps its own checks (type, bytes). */
#include "engine_internal.h"
#include "pp_internal.h"

#include <string.h>

/* bert's layer tensors, each weight beside its bias; see pp_layer_slots_fn. */
static size_t encoder_layer_slots(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd;
    const pp_tensor_slot table[] = {
        {"attn_q.weight", &L->wq, n_embd, n_embd},
        {"attn_q.bias", &L->bq, n_embd, 0},
        {"attn_k.weight", &L->wk, n_embd, n_embd},
        {"attn_k.bias", &L->bk, n_embd, 0},
        {"attn_v.weight", &L->wv, n_embd, n_embd},
        {"attn_v.bias", &L->bv, n_embd, 0},
        {"attn_output.weight", &L->wo, n_embd, n_embd},
        {"attn_output.bias", &L->bo, n_embd, 0},
        {"attn_output_norm.weight", &L->attn_out_norm, n_embd, 0},
        {"attn_output_norm.bias", &L->attn_out_norm_b, n_embd, 0},
        {"ffn_up.weight", &L->ffn_up, n_embd, hp->n_ff},
        {"ffn_up.bias", &L->ffn_up_b, hp->n_ff, 0},
        {"ffn_down.weight", &L->ffn_down, hp->n_ff, n_embd},
        {"ffn_down.bias", &L->ffn_down_b, n_embd, 0},
        {"layer_output_norm.weight", &L->layer_out_norm, n_embd, 0},
        {"layer_output_norm.bias", &L->layer_out_norm_b, n_embd, 0},
    };
    _Static_assert(sizeof table <= PP_MAX_LAYER_SLOTS * sizeof table[0], "raise PP_MAX_LAYER_SLOTS");
    memcpy(out, table, sizeof table);
    return sizeof table / sizeof table[0];
}

int pp_encoder_resolve(pp_model *m, const char *name, pp_tensor_slot *spec) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd, n_types = hp->n_token_types > 0 ? hp->n_token_types : 2;
    const pp_tensor_slot globals[] = {
        {"token_embd.weight", &m->tok_embd, n_embd, hp->n_vocab},
        {"token_types.weight", &m->tok_types, n_embd, n_types},
        {"position_embd.weight", &m->pos_embd, n_embd, hp->n_ctx_train},
        {"token_embd_norm.weight", &m->embd_norm, n_embd, 0},
        {"token_embd_norm.bias", &m->embd_norm_b, n_embd, 0},
    };
    return pp_resolve_tensor(m, name, globals, sizeof globals / sizeof globals[0], encoder_layer_slots, spec);
}

int32_t pp_encoder_finalize(const pp_model *m) {
    if (m->hp.n_head * m->hp.head_dim != m->hp.n_embd || m->hp.n_head_kv != m->hp.n_head)
        return pp_fail(PP_ERR_INVALID, "bert: head_count %d x key_length %d must equal embedding_length %d, "
                       "without grouped keys", m->hp.n_head, m->hp.head_dim, m->hp.n_embd);
    if (!m->tok_embd) return pp_fail(PP_ERR_INVALID, "missing tensor 'token_embd.weight'");
    if (!m->pos_embd) return pp_fail(PP_ERR_INVALID, "missing tensor 'position_embd.weight'");
    if (!m->embd_norm || !m->embd_norm_b)
        return pp_fail(PP_ERR_INVALID, "missing tensor 'token_embd_norm.%s'", m->embd_norm ? "bias" : "weight");
    /* token_types.weight is optional: without it every token is type 0 of nothing added */
    for (int il = 0; il < m->hp.n_layer; il++) {
        const pp_layer *L = &m->layers[il];
#define NEED(field, suffix) \
        if (!L->field) return pp_fail(PP_ERR_INVALID, "missing tensor 'blk.%d.%s'", il, suffix)
        NEED(wq, "attn_q.weight");
        NEED(wk, "attn_k.weight");
        NEED(wv, "attn_v.weight");
        NEED(bq, "attn_q.bias");
        NEED(bk, "attn_k.bias");
        NEED(bv, "attn_v.bias");
        NEED(wo, "attn_output.weight");
        NEED(bo, "attn_output.bias");
        NEED(attn_out_norm, "attn_output_norm.weight");
        NEED(attn_out_norm_b, "attn_output_norm.bias");
        NEED(ffn_up, "ffn_up.weight");
        NEED(ffn_up_b, "ffn_up.bias");
        NEED(ffn_down, "ffn_down.weight");
        NEED(ffn_down_b, "ffn_down.bias");
        NEED(layer_out_norm, "layer_output_norm.weight");
        NEED(layer_out_norm_b, "layer_output_norm.bias");
#undef NEED
    }
    return PP_OK;
}
