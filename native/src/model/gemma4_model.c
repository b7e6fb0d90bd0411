/* Gemma 4's weights (llama.cpp's gemma4 architecture): its tensor table, whose
 * shapes differ from layer to layer (sliding and full layers have their own head
 * sizes and KV heads; the last layers may share an earlier layer's KV and then
 * have no K projection; a per-layer FFN width), the check of the per-layer
 * hyper-parameters every architecture may pass, and the check that a layer with
 * experts has their gate and up in one of the two forms a file may hold. */
#include "model/tensor_table.h"

#include <string.h>

int32_t pp_check_layer_shapes(const pp_model_hparams *hp) {
    for (int il = 0; il < hp->n_layer; il++) {
        const int32_t hd = hp->layer_head_dim ? hp->layer_head_dim[il] : hp->head_dim;
        const int32_t kv = hp->layer_n_head_kv ? hp->layer_n_head_kv[il] : hp->n_head_kv;
        const int32_t rot = hp->layer_n_rot ? hp->layer_n_rot[il] : hp->n_rot;
        const int32_t src = hp->layer_kv_source ? hp->layer_kv_source[il] : -1;
        if (hd <= 0 || hd > hp->head_dim || hd % 2)
            return pp_fail(PP_ERR_INVALID, "layer %d: head size %d must be even and at most key_length %d", il, hd,
                           hp->head_dim);
        if (kv <= 0 || hp->n_head % kv || hp->n_head / kv > 32)
            return pp_fail(PP_ERR_INVALID, "layer %d: head_count %d must be a multiple of its head_count_kv %d, "
                           "at most 32 times it", il, hp->n_head, kv);
        if (rot < 0 || rot > hd || rot % 2)
            return pp_fail(PP_ERR_INVALID, "layer %d: %d rotated dims must be even and at most its head size %d", il,
                           rot, hd);
        if (hp->layer_n_ff && hp->layer_n_ff[il] <= 0)
            return pp_fail(PP_ERR_INVALID, "layer %d: feed_forward_length %d must be positive", il, hp->layer_n_ff[il]);
        if (src == -1) continue;
        /* a shared layer reads the pools of an earlier layer that writes its own, of its window and shapes */
        const int ok = src >= 0 && src < il && hp->layer_kv_source[src] == -1 &&
                       (hp->layer_window ? hp->layer_window[src] == hp->layer_window[il] : 1) &&
                       (hp->layer_head_dim ? hp->layer_head_dim[src] : hp->head_dim) == hd &&
                       (hp->layer_n_head_kv ? hp->layer_n_head_kv[src] : hp->n_head_kv) == kv;
        if (!ok)
            return pp_fail(PP_ERR_INVALID, "layer %d: its KV source %d is not an earlier layer with KV of its own, "
                           "its window and its head shapes", il, src);
    }
    if (hp->n_embd_per_layer < 0)
        return pp_fail(PP_ERR_INVALID, "embedding_length_per_layer_input %d must be >= 0", hp->n_embd_per_layer);
    return PP_OK;
}

static int has_full_layer(const pp_model *m) {
    for (int il = 0; il < m->hp.n_layer; il++)
        if (m->layer_window[il] == 0) return 1;
    return 0;
}

static size_t gemma4_globals(pp_model *m, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_pl = hp->n_embd_per_layer, n_pl_all = n_pl * hp->n_layer;
    const pp_tensor_slot table[] = {
        {"token_embd.weight", &m->tok_embd, hp->n_embd, hp->n_vocab, 1},
        {"output_norm.weight", &m->output_norm, hp->n_embd, 0, 1},
        {"output.weight", &m->output, hp->n_embd, hp->n_vocab, 0},   /* absent: tied to the embedding */
        /* the full layers' proportional rope (llama.cpp requires it where a full layer is) */
        {"rope_freqs.weight", &m->rope_freqs, hp->n_rot / 2, 0, has_full_layer(m)},
        {"per_layer_token_embd.weight", &m->per_layer_tok_embd, n_pl_all, hp->n_vocab, n_pl > 0},
        {"per_layer_model_proj.weight", &m->per_layer_model_proj, hp->n_embd, n_pl_all, n_pl > 0},
        {"per_layer_proj_norm.weight", &m->per_layer_proj_norm, n_pl, 0, n_pl > 0},
    };
    _Static_assert(sizeof table <= PP_MAX_GLOBAL_SLOTS * sizeof table[0], "raise PP_MAX_GLOBAL_SLOTS");
    /* a file that says it has no per-layer embeddings has none to give */
    const size_t n = sizeof table / sizeof table[0] - (n_pl > 0 ? 0 : 3);
    memcpy(out, table, n * sizeof table[0]);
    return n;
}

/* The router, its scale, the norms around the experts and the experts themselves: gate and
 * up fused (what the converter writes) or apart, checked in pp_gemma4_finalize. */
static size_t gemma4_experts(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const int64_t n_embd = m->hp.n_embd, n_ff = m->hp.n_ff_exp, n_expert = m->hp.n_expert;
    const pp_tensor_slot table[] = {
        {"ffn_gate_inp.weight", &L->ffn_gate_inp, n_embd, n_expert, 1},
        {"ffn_gate_inp.scale", &L->ffn_gate_inp_s, n_embd, 0, 1},
        {"pre_ffw_norm_2.weight", &L->ffn_pre_norm_2, n_embd, 0, 1},
        {"post_ffw_norm_1.weight", &L->ffn_post_norm_1, n_embd, 0, 1},
        {"post_ffw_norm_2.weight", &L->ffn_post_norm_2, n_embd, 0, 1},
        {"ffn_gate_up_exps.weight", &L->ffn_gate_up_exps, n_embd, 2 * n_ff, 0, n_expert},
        {"ffn_gate_exps.weight", &L->ffn_gate_exps, n_embd, n_ff, 0, n_expert},
        {"ffn_up_exps.weight", &L->ffn_up_exps, n_embd, n_ff, 0, n_expert},
        {"ffn_down_exps.weight", &L->ffn_down_exps, n_ff, n_embd, 1, n_expert},
        {"ffn_down_exps.scale", &L->ffn_down_exps_s, n_expert, 0, 0},
    };
    memcpy(out, table, sizeof table);
    return sizeof table / sizeof table[0];
}

static size_t gemma4_layer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int il = (int)(L - m->layers);
    const int owns_kv = pp_layer_kv_source(m, il) == il;
    const int64_t n_embd = hp->n_embd, hd = pp_layer_head_dim(m, il), q_dim = (int64_t)hp->n_head * hd,
                  kv_dim = pp_layer_n_embd_kv(m, il), n_ff = pp_layer_n_ff(m, il), n_pl = hp->n_embd_per_layer;
    const pp_tensor_slot table[] = {
        {"attn_norm.weight", &L->attn_norm, n_embd, 0, 1},
        {"attn_q.weight", &L->wq, n_embd, q_dim, 1},
        /* a layer reading an earlier layer's KV has no K (nor V); a missing V is K */
        {"attn_k.weight", &L->wk, n_embd, kv_dim, owns_kv},
        {"attn_v.weight", &L->wv, n_embd, kv_dim, 0},
        {"attn_output.weight", &L->wo, q_dim, n_embd, 1},
        {"attn_q_norm.weight", &L->q_norm, hd, 0, 1},
        {"attn_k_norm.weight", &L->k_norm, hd, 0, owns_kv},
        {"post_attention_norm.weight", &L->post_attn_norm, n_embd, 0, 1},
        {"layer_output_scale.weight", &L->out_scale, 1, 0, 0},
        {"ffn_norm.weight", &L->ffn_norm, n_embd, 0, 1},
        {"ffn_gate.weight", &L->ffn_gate, n_embd, n_ff, 1},
        {"ffn_up.weight", &L->ffn_up, n_embd, n_ff, 1},
        {"ffn_down.weight", &L->ffn_down, n_ff, n_embd, 1},
        {"post_ffw_norm.weight", &L->post_ffw_norm, n_embd, 0, 1},
        {"inp_gate.weight", &L->per_layer_inp_gate, n_embd, n_pl, 1},
        {"proj.weight", &L->per_layer_proj, n_pl, n_embd, 1},
        {"post_norm.weight", &L->per_layer_post_norm, n_embd, 0, 1},
    };
    _Static_assert(sizeof table + 10 * sizeof table[0] <= PP_MAX_LAYER_SLOTS * sizeof table[0],
                   "raise PP_MAX_LAYER_SLOTS");
    /* the per-layer embedding's three slots are the table's last */
    const size_t n = sizeof table / sizeof table[0] - (n_pl > 0 ? 0 : 3);
    memcpy(out, table, n * sizeof table[0]);
    return n + (hp->n_expert > 0 ? gemma4_experts(m, L, out + n) : 0);
}

const pp_tensor_table pp_gemma4_tensors = {gemma4_globals, gemma4_layer};

int32_t pp_gemma4_finalize(pp_model *m) {
    const int32_t st = pp_check_tensors(m, &pp_gemma4_tensors);
    if (st != PP_OK || m->hp.n_expert == 0) return st;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const pp_layer *L = &m->layers[il];
        const int apart = L->ffn_gate_exps && L->ffn_up_exps;
        if (L->ffn_gate_up_exps ? (L->ffn_gate_exps || L->ffn_up_exps) : !apart)
            return pp_fail(PP_ERR_INVALID, "layer %d: the experts' gate and up must be either "
                           "'blk.%d.ffn_gate_up_exps.weight' or both 'blk.%d.ffn_gate_exps.weight' and "
                           "'blk.%d.ffn_up_exps.weight'", il, il, il, il);
    }
    return PP_OK;
}
