/* The tensors of an encoder-only (bert) model, by llama.cpp's GGUF names:
 * where each goes in pp_model, the shape the hyper-parameters give it and
 * which the model needs (tensor_table.h). model.c hands bert names here and
 * keeps its own checks (type, bytes). */
#include "model/tensor_table.h"

#include <string.h>

static size_t encoder_globals(pp_model *m, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd, n_types = hp->n_token_types > 0 ? hp->n_token_types : 2;
    const pp_tensor_slot table[] = {
        {"token_embd.weight", &m->tok_embd, n_embd, hp->n_vocab, 1},
        /* absent: every token is type 0 of nothing added */
        {"token_types.weight", &m->tok_types, n_embd, n_types, 0},
        {"position_embd.weight", &m->pos_embd, n_embd, hp->n_ctx_train, 1},
        {"token_embd_norm.weight", &m->embd_norm, n_embd, 0, 1},
        {"token_embd_norm.bias", &m->embd_norm_b, n_embd, 0, 1},
    };
    PP_RETURN_GLOBAL_SLOTS(table);
}

/* bert's layer tensors, every one required. */
static size_t encoder_layer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd;
    const pp_tensor_slot table[] = {
        {"attn_q.weight", &L->wq, n_embd, n_embd, 1},
        {"attn_k.weight", &L->wk, n_embd, n_embd, 1},
        {"attn_v.weight", &L->wv, n_embd, n_embd, 1},
        {"attn_q.bias", &L->bq, n_embd, 0, 1},
        {"attn_k.bias", &L->bk, n_embd, 0, 1},
        {"attn_v.bias", &L->bv, n_embd, 0, 1},
        {"attn_output.weight", &L->wo, n_embd, n_embd, 1},
        {"attn_output.bias", &L->bo, n_embd, 0, 1},
        {"attn_output_norm.weight", &L->attn_out_norm, n_embd, 0, 1},
        {"attn_output_norm.bias", &L->attn_out_norm_b, n_embd, 0, 1},
        {"ffn_up.weight", &L->ffn_up, n_embd, hp->n_ff, 1},
        {"ffn_up.bias", &L->ffn_up_b, hp->n_ff, 0, 1},
        {"ffn_down.weight", &L->ffn_down, hp->n_ff, n_embd, 1},
        {"ffn_down.bias", &L->ffn_down_b, n_embd, 0, 1},
        {"layer_output_norm.weight", &L->layer_out_norm, n_embd, 0, 1},
        {"layer_output_norm.bias", &L->layer_out_norm_b, n_embd, 0, 1},
    };
    _Static_assert(sizeof table <= PP_MAX_LAYER_SLOTS * sizeof table[0], "raise PP_MAX_LAYER_SLOTS");
    memcpy(out, table, sizeof table);
    return sizeof table / sizeof table[0];
}

static const pp_tensor_table encoder_tensors = {encoder_globals, encoder_layer};

int pp_encoder_resolve(pp_model *m, const char *name, pp_tensor_slot *spec) {
    return pp_resolve_tensor(m, &encoder_tensors, name, spec);
}

int32_t pp_encoder_finalize(pp_model *m) {
    if (m->hp.n_head * m->hp.head_dim != m->hp.n_embd || m->hp.n_head_kv != m->hp.n_head)
        return pp_fail(PP_ERR_INVALID, "bert: head_count %d x key_length %d must equal embedding_length %d, "
                       "without grouped keys", m->hp.n_head, m->hp.head_dim, m->hp.n_embd);
    return pp_check_tensors(m, &encoder_tensors);
}
