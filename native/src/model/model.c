/* Model weights: hyper-parameter checks and the tensor registry, with the
 * decoders' tensor tables (bert's are in encoder_model.c; both are looked up
 * through tensor_table.c). The bytes stay in the caller's mapping of the
 * GGUF file; we only describe them. */
#include "common/engine_internal.h"
#include "model/tensor_table.h"
#include "panels/panels.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The most experts a layer may route among: llama.cpp's own limit. */
#define PP_MAX_EXPERTS 1024

/* Whether an architecture's FFN is routed experts (else one dense FFN per layer). */
static int arch_routes_experts(int32_t arch) {
    return arch == PP_ARCH_QWEN3MOE || arch == PP_ARCH_GPT_OSS || arch == PP_ARCH_QWEN35MOE;
}

/* Whether an architecture mixes Gated DeltaNet layers with full-attention ones. */
static int arch_is_hybrid(int32_t arch) { return arch == PP_ARCH_QWEN35 || arch == PP_ARCH_QWEN35MOE; }

#define PP_ROPE_IMROPE 40   /* GGML_ROPE_TYPE_IMROPE */
#define PP_MAX_D_CONV 64

/* A hybrid's own hyper-parameters: layer kinds, the linear layers' sizes, IMRoPE's sections. */
static int32_t check_hybrid(const pp_model_hparams *hp) {
#define REQUIRE(cond, ...) do { if (!(cond)) return pp_fail(PP_ERR_INVALID, __VA_ARGS__); } while (0)
    REQUIRE(hp->layer_recurrent, "a hybrid model needs its layer kinds (layer_recurrent)");
    int n_recurrent = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        REQUIRE(hp->layer_recurrent[il] == 0 || hp->layer_recurrent[il] == 1,
                "layer_recurrent[%d] = %d must be 0 or 1", il, hp->layer_recurrent[il]);
        n_recurrent += hp->layer_recurrent[il];
    }
    REQUIRE(n_recurrent > 0 && n_recurrent < hp->n_layer,
            "a hybrid needs recurrent and full-attention layers (%d of %d layers recurrent)", n_recurrent,
            hp->n_layer);
    REQUIRE(hp->rope_type == PP_ROPE_IMROPE, "a hybrid's rope type must be IMRoPE (%d), got %d", PP_ROPE_IMROPE,
            hp->rope_type);
    REQUIRE(hp->ssm_d_conv >= 2 && hp->ssm_d_conv <= PP_MAX_D_CONV, "ssm.conv_kernel %d outside [2, %d]",
            hp->ssm_d_conv, PP_MAX_D_CONV);
    REQUIRE(hp->ssm_d_state > 0 && hp->ssm_d_state <= 1024, "ssm.state_size %d outside [1, 1024]", hp->ssm_d_state);
    REQUIRE(hp->ssm_n_group > 0 && hp->ssm_dt_rank > 0 && hp->ssm_dt_rank % hp->ssm_n_group == 0 &&
                hp->ssm_dt_rank <= 4096,
            "ssm.time_step_rank %d (value heads) must be a positive multiple of ssm.group_count %d (key heads), "
            "at most 4096", hp->ssm_dt_rank, hp->ssm_n_group);
    int32_t sections = 0;
    for (int i = 0; i < 4; i++) {
        REQUIRE(hp->rope_sections[i] >= 0 && hp->rope_sections[i] <= hp->head_dim,
                "rope section %d = %d outside [0, %d]", i, hp->rope_sections[i], hp->head_dim);
        sections += hp->rope_sections[i];
    }
    /* GGML's rope asserts both */
    REQUIRE(hp->rope_sections[0] + hp->rope_sections[1] + hp->rope_sections[2] > 0 && sections <= hp->head_dim,
            "rope sections %d/%d/%d/%d must give the first three some pairs and sum to at most key_length %d",
            hp->rope_sections[0], hp->rope_sections[1], hp->rope_sections[2], hp->rope_sections[3], hp->head_dim);
    if (hp->arch == PP_ARCH_QWEN35MOE)
        REQUIRE(hp->n_ff_shexp > 0, "expert_shared_feed_forward_length %d must be positive", hp->n_ff_shexp);
#undef REQUIRE
    return PP_OK;
}

/* The model's own copies of hp's per-layer arrays (one allocation, m->layer_shapes), its
 * hp pointing at them; PP_ERR_NO_MEMORY leaves m to be destroyed. */
static int32_t copy_layer_shapes(pp_model *m, const pp_model_hparams *hp) {
    const int32_t *src[] = {hp->layer_head_dim, hp->layer_n_head_kv, hp->layer_n_rot, hp->layer_n_ff,
                            hp->layer_kv_source};
    const int32_t **dst[] = {&m->hp.layer_head_dim, &m->hp.layer_n_head_kv, &m->hp.layer_n_rot, &m->hp.layer_n_ff,
                             &m->hp.layer_kv_source};
    const size_t n_arrays = sizeof src / sizeof src[0], n = (size_t)hp->n_layer;
    m->layer_shapes = malloc(n_arrays * n * sizeof(int32_t));
    if (!m->layer_shapes) return PP_ERR_NO_MEMORY;
    for (size_t a = 0; a < n_arrays; a++) {
        int32_t *copy = m->layer_shapes + a * n;
        if (src[a]) memcpy(copy, src[a], n * sizeof(int32_t));
        *dst[a] = src[a] ? copy : NULL;
    }
    return PP_OK;
}

int32_t pp_model_create(const pp_model_hparams *hp, pp_model **out) {
    if (!hp || !out) return pp_fail(PP_ERR_INVALID, "pp_model_create: NULL argument");
    *out = NULL;
#define REQUIRE(cond, ...) do { if (!(cond)) return pp_fail(PP_ERR_INVALID, __VA_ARGS__); } while (0)
    REQUIRE(hp->arch >= PP_ARCH_LLAMA && hp->arch <= PP_ARCH_GEMMA4, "unknown architecture id %d", hp->arch);
    REQUIRE(hp->n_layer > 0 && hp->n_layer <= 512, "block_count %d out of range", hp->n_layer);
    REQUIRE(hp->n_embd > 0, "embedding_length %d must be positive", hp->n_embd);
    REQUIRE(hp->n_head > 0 && hp->n_head_kv > 0 && hp->n_head % hp->n_head_kv == 0,
            "head_count %d must be a positive multiple of head_count_kv %d", hp->n_head, hp->n_head_kv);
    REQUIRE(hp->n_head / hp->n_head_kv <= 32, "GQA ratio %d above the supported 32", hp->n_head / hp->n_head_kv);
    REQUIRE(hp->head_dim > 0 && hp->head_dim <= 512 && hp->head_dim % 2 == 0,
            "key_length %d must be even and at most 512", hp->head_dim);
    REQUIRE(hp->n_ff > 0, "feed_forward_length %d must be positive", hp->n_ff);
    REQUIRE(hp->n_vocab > 0, "vocabulary size %d must be positive", hp->n_vocab);
    REQUIRE(hp->rope_type == 0 || hp->rope_type == 2 || (arch_is_hybrid(hp->arch) && hp->rope_type == PP_ROPE_IMROPE),
            "rope type %d unsupported", hp->rope_type);
    REQUIRE(hp->n_rot >= 0 && hp->n_rot <= hp->head_dim && hp->n_rot % 2 == 0,
            "rope.dimension_count %d must be even and at most key_length %d", hp->n_rot, hp->head_dim);
    REQUIRE(hp->rms_eps > 0, "layer_norm_rms_epsilon must be positive");
    /* written as ranges that NaN fails */
    REQUIRE(hp->rope_freq_scale_swa >= 0 && hp->rope_freq_scale_swa <= 1e6f,
            "rope_freq_scale_swa %g must be finite and >= 0", (double)hp->rope_freq_scale_swa);
    REQUIRE(hp->yarn_ext_factor >= 0 && hp->yarn_ext_factor <= 1, "yarn_ext_factor %g must be in [0, 1]",
            (double)hp->yarn_ext_factor);
    REQUIRE(hp->yarn_attn_factor >= 0 && hp->yarn_attn_factor <= 1e6f, "yarn_attn_factor %g must be finite and >= 0",
            (double)hp->yarn_attn_factor);
    REQUIRE(hp->n_ctx_orig_yarn >= 0, "n_ctx_orig_yarn %d must be >= 0", hp->n_ctx_orig_yarn);
    if (hp->yarn_ext_factor != 0)
        REQUIRE(hp->yarn_beta_slow > 0 && hp->yarn_beta_fast > hp->yarn_beta_slow && hp->yarn_beta_fast <= 1e6f,
                "yarn_beta_fast %g must be above yarn_beta_slow %g, both positive", (double)hp->yarn_beta_fast,
                (double)hp->yarn_beta_slow);
    if (arch_routes_experts(hp->arch) || (hp->arch == PP_ARCH_GEMMA4 && hp->n_expert > 0)) {
        REQUIRE(hp->n_expert > 0 && hp->n_expert <= PP_MAX_EXPERTS, "expert_count %d must be between 1 and %d",
                hp->n_expert, PP_MAX_EXPERTS);
        REQUIRE(hp->n_expert_used > 0 && hp->n_expert_used <= hp->n_expert,
                "expert_used_count %d must be between 1 and expert_count %d", hp->n_expert_used, hp->n_expert);
        REQUIRE(hp->n_ff_exp > 0, "expert_feed_forward_length %d must be positive", hp->n_ff_exp);
    } else {
        REQUIRE(hp->n_expert == 0 && hp->n_expert_used == 0,
                "expert_count %d / expert_used_count %d given for an architecture without experts",
                hp->n_expert, hp->n_expert_used);
    }
#undef REQUIRE
    const int32_t shapes = pp_check_layer_shapes(hp);
    if (shapes != PP_OK) return shapes;
    if (arch_is_hybrid(hp->arch)) {
        const int32_t st = check_hybrid(hp);
        if (st != PP_OK) return st;
    }
    pp_model *m = calloc(1, sizeof *m);
    if (!m) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the model");
    m->hp = *hp;
    m->device = -1;
    if (m->hp.n_rot == 0) m->hp.n_rot = hp->head_dim;
    m->layer_window = calloc((size_t)hp->n_layer, sizeof(int32_t));
    m->layers = calloc((size_t)hp->n_layer, sizeof(pp_layer));
    size_t n_tensors = 4 + (size_t)hp->n_layer * PP_MAX_LAYER_SLOTS;
    struct ggml_init_params params = {
        .mem_size = n_tensors * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    m->weights = ggml_init(params);
    if (!m->layer_window || !m->layers || !m->weights) {
        pp_model_destroy(m);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the model's tables");
    }
    if (hp->layer_window) memcpy(m->layer_window, hp->layer_window, sizeof(int32_t) * hp->n_layer);
    m->hp.layer_window = m->layer_window;
    if (copy_layer_shapes(m, hp) != PP_OK) {
        pp_model_destroy(m);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the model's per-layer shapes");
    }
    m->hp.layer_recurrent = NULL;
    if (arch_is_hybrid(hp->arch)) {
        m->layer_recurrent = malloc(sizeof(int32_t) * (size_t)hp->n_layer);
        if (!m->layer_recurrent) {
            pp_model_destroy(m);
            return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the model's tables");
        }
        memcpy(m->layer_recurrent, hp->layer_recurrent, sizeof(int32_t) * hp->n_layer);
        for (int il = 0; il < hp->n_layer; il++) m->n_recurrent += m->layer_recurrent[il];
        m->hp.layer_recurrent = m->layer_recurrent;
    }
    if (m->hp.rope_freq_scale_swa == 0) m->hp.rope_freq_scale_swa = 1.0f;
    if (m->hp.yarn_attn_factor == 0) m->hp.yarn_attn_factor = 1.0f;
    if (m->hp.n_ctx_orig_yarn == 0) m->hp.n_ctx_orig_yarn = hp->n_ctx_train;
    *out = m;
    return PP_OK;
}

void pp_model_destroy(pp_model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_repack_buffers; i++) ggml_backend_buffer_free(m->repack_buffers[i]);
    if (m->device_buffer) ggml_backend_buffer_free(m->device_buffer);
    if (m->mapped_buffer) ggml_backend_buffer_free(m->mapped_buffer);
    if (m->device_weights) ggml_free(m->device_weights);
    for (int i = 0; m->panels && i < m->n_panel_slots; i++) pp_q8_panels_free(m->panels[i]);
    free(m->panels);
    for (int i = 0; m->expert_panels && i < m->n_panel_slots; i++) pp_expert_panels_free(m->expert_panels[i]);
    free(m->expert_panels);
    if (m->weights) ggml_free(m->weights);
    free(m->layer_window);
    free(m->layer_recurrent);
    free(m->layers);
    free(m->layer_shapes);
    free(m);
}

/* The decoders' tensors (llama, qwen2, qwen3, gemma3, qwen3moe; gpt-oss's and the hybrids'
 * layers have tables of their own); see pp_tensor_table. */
static size_t decoder_globals(pp_model *m, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const pp_tensor_slot table[] = {
        {"token_embd.weight", &m->tok_embd, hp->n_embd, hp->n_vocab, 1},
        {"output_norm.weight", &m->output_norm, hp->n_embd, 0, 1},
        {"output.weight", &m->output, hp->n_embd, hp->n_vocab, 0},   /* absent: tied to the embedding */
        {"rope_freqs.weight", &m->rope_freqs, hp->n_rot / 2, 0, 0},
    };
    PP_RETURN_GLOBAL_SLOTS(table);
}

/* A layer's feed-forward tensors: one dense FFN, or a router and its experts
 * (a name of the other kind is not the model's, and is ignored). */
static size_t decoder_ffn(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd;
    if (!arch_routes_experts(hp->arch)) {
        const pp_tensor_slot dense[] = {
            {"ffn_gate.weight", &L->ffn_gate, n_embd, hp->n_ff, 1},
            {"ffn_up.weight", &L->ffn_up, n_embd, hp->n_ff, 1},
            {"ffn_down.weight", &L->ffn_down, hp->n_ff, n_embd, 1},
        };
        memcpy(out, dense, sizeof dense);
        return sizeof dense / sizeof dense[0];
    }
    const int64_t n_ff = hp->n_ff_exp, n_expert = hp->n_expert;
    const pp_tensor_slot experts[] = {
        {"ffn_gate_inp.weight", &L->ffn_gate_inp, n_embd, n_expert, 1},
        {"ffn_gate_exps.weight", &L->ffn_gate_exps, n_embd, n_ff, 1, n_expert},
        {"ffn_up_exps.weight", &L->ffn_up_exps, n_embd, n_ff, 1, n_expert},
        {"ffn_down_exps.weight", &L->ffn_down_exps, n_ff, n_embd, 1, n_expert},
    };
    memcpy(out, experts, sizeof experts);
    return sizeof experts / sizeof experts[0];
}

/* A layer's own slots, then its FFN's (at most 4 more): out holds both; their count. */
#define TABLE_THEN_FFN(table)                                                                      \
    do {                                                                                           \
        _Static_assert(sizeof(table) + 4 * sizeof(table)[0] <= PP_MAX_LAYER_SLOTS * sizeof(table)[0], \
                       "raise PP_MAX_LAYER_SLOTS");                                               \
        memcpy(out, (table), sizeof(table));                                                       \
        return sizeof(table) / sizeof(table)[0] + decoder_ffn(m, L, out + sizeof(table) / sizeof(table)[0]); \
    } while (0)

/* A decoder layer's attention norm and projections (n_embd, q_dim, kv_dim in scope). */
#define ATTENTION_SLOTS                                                                            \
    {"attn_norm.weight", &L->attn_norm, n_embd, 0, 1}, {"attn_q.weight", &L->wq, n_embd, q_dim, 1}, \
        {"attn_k.weight", &L->wk, n_embd, kv_dim, 1}, {"attn_v.weight", &L->wv, n_embd, kv_dim, 1}, \
        {"attn_output.weight", &L->wo, q_dim, n_embd, 1}

static size_t decoder_layer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd, q_dim = (int64_t)hp->n_head * hp->head_dim,
                  kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    const int arch = hp->arch,
              qk_norm = arch == PP_ARCH_QWEN3 || arch == PP_ARCH_GEMMA3 || arch == PP_ARCH_QWEN3MOE;
    const pp_tensor_slot table[] = {
        ATTENTION_SLOTS,
        {"ffn_norm.weight", &L->ffn_norm, n_embd, 0, 1},
        {"attn_q.bias", &L->bq, q_dim, 0, arch == PP_ARCH_QWEN2},
        {"attn_k.bias", &L->bk, kv_dim, 0, arch == PP_ARCH_QWEN2},
        {"attn_v.bias", &L->bv, kv_dim, 0, arch == PP_ARCH_QWEN2},
        {"attn_q_norm.weight", &L->q_norm, hp->head_dim, 0, qk_norm},
        {"attn_k_norm.weight", &L->k_norm, hp->head_dim, 0, qk_norm},
        {"post_attention_norm.weight", &L->post_attn_norm, n_embd, 0, arch == PP_ARCH_GEMMA3},
        {"post_ffw_norm.weight", &L->post_ffw_norm, n_embd, 0, arch == PP_ARCH_GEMMA3},
    };
    /* the FFN's slots (at most 4) follow */
    TABLE_THEN_FFN(table);
}

static const pp_tensor_table decoder_tensors = {decoder_globals, decoder_layer};

/* gpt-oss's layer (llama.cpp's openai-moe): every projection has a bias, a
 * sink logit per head, post_attention_norm as the FFN's input norm (it has
 * no ffn_norm and nothing normalises the attention output), and routed
 * experts whose router and matrices have biases. */
static size_t gpt_oss_layer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd, q_dim = (int64_t)hp->n_head * hp->head_dim,
                  kv_dim = (int64_t)hp->n_head_kv * hp->head_dim, n_ff = hp->n_ff_exp, n_expert = hp->n_expert;
    const pp_tensor_slot table[] = {
        ATTENTION_SLOTS,
        {"attn_q.bias", &L->bq, q_dim, 0, 1},
        {"attn_k.bias", &L->bk, kv_dim, 0, 1},
        {"attn_v.bias", &L->bv, kv_dim, 0, 1},
        {"attn_output.bias", &L->bo, n_embd, 0, 1},
        {"attn_sinks.weight", &L->attn_sinks, hp->n_head, 0, 1},
        {"post_attention_norm.weight", &L->ffn_norm, n_embd, 0, 1},
        {"ffn_gate_inp.bias", &L->ffn_gate_inp_b, n_expert, 0, 1},
        {"ffn_gate_exps.bias", &L->ffn_gate_exps_b, n_ff, n_expert, 1},
        {"ffn_up_exps.bias", &L->ffn_up_exps_b, n_ff, n_expert, 1},
        {"ffn_down_exps.bias", &L->ffn_down_exps_b, n_embd, n_expert, 1},
    };
    /* the experts' slots (4) follow */
    TABLE_THEN_FFN(table);
}

static const pp_tensor_table gpt_oss_tensors = {decoder_globals, gpt_oss_layer};

/* A hybrid's Gated DeltaNet mixer (llama.cpp's qwen35 names; the kernel must be f32, as
 * ggml_ssm_conv reads it so). */
static size_t delta_net_mixer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd, key_dim = (int64_t)hp->ssm_n_group * hp->ssm_d_state,
                  value_dim = (int64_t)hp->ssm_dt_rank * hp->ssm_d_state, channels = 2 * key_dim + value_dim;
    const pp_tensor_slot table[] = {
        {"attn_qkv.weight", &L->ssm_in, n_embd, channels, 1},
        {"attn_gate.weight", &L->ssm_gate, n_embd, value_dim, 1},
        {"ssm_conv1d.weight", &L->ssm_conv1d, hp->ssm_d_conv, channels, 1, 0, 1},
        {"ssm_dt.bias", &L->ssm_dt_b, hp->ssm_dt_rank, 0, 1},
        {"ssm_a", &L->ssm_a, hp->ssm_dt_rank, 0, 1},
        {"ssm_beta.weight", &L->ssm_beta, n_embd, hp->ssm_dt_rank, 1},
        {"ssm_alpha.weight", &L->ssm_alpha, n_embd, hp->ssm_dt_rank, 1},
        {"ssm_norm.weight", &L->ssm_norm, hp->ssm_d_state, 0, 1},
        {"ssm_out.weight", &L->ssm_out, value_dim, n_embd, 1},
    };
    memcpy(out, table, sizeof table);
    return sizeof table / sizeof table[0];
}

/* A hybrid's full-attention mixer: attn_q gives each head's query and output gate. */
static size_t gated_attention_mixer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd, q_dim = (int64_t)hp->n_head * hp->head_dim,
                  kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    const pp_tensor_slot table[] = {
        {"attn_q.weight", &L->wq, n_embd, 2 * q_dim, 1},
        {"attn_k.weight", &L->wk, n_embd, kv_dim, 1},
        {"attn_v.weight", &L->wv, n_embd, kv_dim, 1},
        {"attn_output.weight", &L->wo, q_dim, n_embd, 1},
        {"attn_q_norm.weight", &L->q_norm, hp->head_dim, 0, 1},
        {"attn_k_norm.weight", &L->k_norm, hp->head_dim, 0, 1},
    };
    memcpy(out, table, sizeof table);
    return sizeof table / sizeof table[0];
}

/* A qwen35 / qwen35moe layer: its norms, the mixer of its kind, and the FFN (qwen35moe's with
 * a shared expert; its gate row is 1-D, so f32). post_attention_norm is the FFN's norm. */
static size_t hybrid_layer(const pp_model *m, pp_layer *L, pp_tensor_slot *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t n_embd = hp->n_embd;
    const int recurrent = m->layer_recurrent[L - m->layers];
    size_t n = 0;
    out[n++] = (pp_tensor_slot){"attn_norm.weight", &L->attn_norm, n_embd, 0, 1};
    out[n++] = (pp_tensor_slot){"post_attention_norm.weight", &L->ffn_norm, n_embd, 0, 1};
    n += recurrent ? delta_net_mixer(m, L, out + n) : gated_attention_mixer(m, L, out + n);
    n += decoder_ffn(m, L, out + n);
    if (hp->arch == PP_ARCH_QWEN35MOE) {
        const pp_tensor_slot shared[] = {
            {"ffn_gate_inp_shexp.weight", &L->ffn_gate_inp_shexp, n_embd, 0, 1},
            {"ffn_gate_shexp.weight", &L->ffn_gate_shexp, n_embd, hp->n_ff_shexp, 1},
            {"ffn_up_shexp.weight", &L->ffn_up_shexp, n_embd, hp->n_ff_shexp, 1},
            {"ffn_down_shexp.weight", &L->ffn_down_shexp, hp->n_ff_shexp, n_embd, 1},
        };
        memcpy(out + n, shared, sizeof shared);
        n += sizeof shared / sizeof shared[0];
    }
    /* 2 norms, a mixer (at most 9), the experts (4) and the shared expert (4) */
    _Static_assert(2 + 9 + 4 + 4 <= PP_MAX_LAYER_SLOTS, "raise PP_MAX_LAYER_SLOTS");
    return n;
}

static const pp_tensor_table hybrid_tensors = {decoder_globals, hybrid_layer};

static const pp_tensor_table *decoder_table(const pp_model *m) {
    if (m->hp.arch == PP_ARCH_GEMMA4) return &pp_gemma4_tensors;
    if (arch_is_hybrid(m->hp.arch)) return &hybrid_tensors;
    return m->hp.arch == PP_ARCH_GPT_OSS ? &gpt_oss_tensors : &decoder_tensors;
}

/* Where a named tensor goes (1, with *spec) or 0 for a name the model does not use. */
static int resolve(pp_model *m, const char *name, pp_tensor_slot *spec) {
    if (m->hp.arch == PP_ARCH_BERT) return pp_encoder_resolve(m, name, spec);
    return pp_resolve_tensor(m, decoder_table(m), name, spec);
}

/* Whether name is a bias (ggml_add and ggml_add_id take them in f32 only). */
static int is_bias(const char *name) {
    const size_t n = strlen(name), k = sizeof ".bias" - 1;
    return n >= k && !strcmp(name + n - k, ".bias");
}

int32_t pp_model_set_tensor(pp_model *m, const char *name, int32_t type, const int64_t *ne,
                            int32_t n_dims, const void *data, int64_t n_bytes, int32_t *used) {
    if (!m || !name || !ne || !data) return pp_fail(PP_ERR_INVALID, "pp_model_set_tensor: NULL argument");
    if (used) *used = 0;
    if (n_dims < 1 || n_dims > GGML_MAX_DIMS)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': %d dimensions (GGML takes 1 to %d)", name, n_dims,
                       GGML_MAX_DIMS);
    pp_tensor_slot spec;
    if (!resolve(m, name, &spec)) return PP_OK;
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type)type) == 0 ||
        ggml_type_size((enum ggml_type)type) == 0)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': unsupported ggml type %d", name, type);
    /* Compared as 2-D (3-D for experts), a 1-D slot being [ne0, 1]: a [ne0, 0] tensor holds no bytes at all. */
    const int max_dims = spec.ne2 ? 3 : 2;
    const int64_t ne1 = n_dims > 1 ? ne[1] : 1, want1 = spec.ne1 ? spec.ne1 : 1;
    const int64_t ne2 = n_dims > 2 ? ne[2] : 1, want2 = spec.ne2 ? spec.ne2 : 1;
    for (int d = max_dims; d < n_dims; d++)
        if (ne[d] != 1)
            return pp_fail(PP_ERR_INVALID, "tensor '%s': expected at most %d dimensions", name, max_dims);
    if (spec.ne2 && (ne[0] != spec.ne0 || ne1 != want1 || ne2 != want2))
        return pp_fail(PP_ERR_INVALID, "tensor '%s': shape [%lld, %lld, %lld] but the hyper-parameters "
                       "need [%lld, %lld, %lld] (one matrix per expert)", name, (long long)ne[0], (long long)ne1,
                       (long long)ne2, (long long)spec.ne0, (long long)want1, (long long)want2);
    if (ne[0] != spec.ne0 || ne1 != want1)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': shape [%lld, %lld] but the hyper-parameters "
                       "need [%lld, %lld]", name, (long long)ne[0], (long long)ne1,
                       (long long)spec.ne0, (long long)want1);
    if (ne[0] % ggml_blck_size((enum ggml_type)type) != 0)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': row of %lld is not whole %s blocks", name,
                       (long long)ne[0], ggml_type_name((enum ggml_type)type));
    if (*spec.slot) return pp_fail(PP_ERR_INVALID, "tensor '%s' given twice", name);
    if (spec.slot == &m->rope_freqs && type != GGML_TYPE_F32)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s, but GGML's RoPE takes f32 frequency factors",
                       name, ggml_type_name((enum ggml_type)type));
    /* Types GGML stores but cannot compute with here would abort inside the
     * first graph, so they are refused now: norms and biases meet f32
     * activations in ggml_mul/ggml_add, which take f32 (as llama.cpp writes
     * every 1-D weight); the 2-D weights feed ggml_mul_mat (the experts
     * ggml_mul_mat_id, the embedding also ggml_get_rows), which needs the
     * type's CPU dot product. */
    if ((!spec.ne1 || is_bias(name)) && type != GGML_TYPE_F32)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s, but norm weights and biases must be f32",
                       name, ggml_type_name((enum ggml_type)type));
    if (spec.f32 && type != GGML_TYPE_F32)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s, but it must be f32 (as llama.cpp's converter "
                       "writes it)", name, ggml_type_name((enum ggml_type)type));
    if (spec.ne1 && !ggml_get_type_traits_cpu((enum ggml_type)type)->vec_dot)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s has no CPU matrix multiplication", name,
                       ggml_type_name((enum ggml_type)type));
    struct ggml_tensor *t = spec.ne2 ? ggml_new_tensor_3d(m->weights, (enum ggml_type)type, spec.ne0, spec.ne1, spec.ne2)
                          : spec.ne1 ? ggml_new_tensor_2d(m->weights, (enum ggml_type)type, spec.ne0, spec.ne1)
                                     : ggml_new_tensor_1d(m->weights, (enum ggml_type)type, spec.ne0);
    if (!t) return pp_fail(PP_ERR_NO_MEMORY, "tensor '%s': no room for metadata", name);
    if (n_bytes < 0 || ggml_nbytes(t) != (size_t)n_bytes) {
        /* t stays in the context, unused: the model is being given up anyway */
        return pp_fail(PP_ERR_INVALID, "tensor '%s': %lld bytes given, but %s of this shape takes %zu",
                       name, (long long)n_bytes, ggml_type_name((enum ggml_type)type), ggml_nbytes(t));
    }
    ggml_set_name(t, name);
    t->data = (void *)data;
    *spec.slot = t;
    if (used) *used = 1;
    return PP_OK;
}

int32_t pp_model_finalize(pp_model *m) {
    if (!m) return pp_fail(PP_ERR_INVALID, "pp_model_finalize: model is NULL");
    const int32_t st = m->hp.arch == PP_ARCH_BERT     ? pp_encoder_finalize(m)
                     : m->hp.arch == PP_ARCH_GEMMA4 ? pp_gemma4_finalize(m)
                                                    : pp_check_tensors(m, decoder_table(m));
    if (st == PP_OK) m->finalized = 1;
    return st;
}
