/* A LoRA adapter's weights: for each projection it changes, the low-rank
 * pair (A, B) read from a GGUF adapter as llama.cpp's converter writes it
 * ("<base tensor>.lora_a" [in, rank], ".lora_b" [rank, out]), checked
 * against the base model's shapes and copied into a buffer the adapter owns,
 * so the file can be unmapped and the adapter freed while the model lives.
 * The base weights are never touched: a step adds B (A x) beside them
 * (lora_graph.c), which is what lets sequences with different adapters, or
 * none, share one step. */
#include "model/lora.h"
#include "common/pp_internal.h"
#include "model/tensor_table.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct pp_lora {
    const pp_model      *model;
    float                alpha;
    uint64_t             uid;
    pp_lora_pair        *pairs;     /* [n_layer * PP_N_PROJ]: a NULL a means not adapted */
    const void         **sources;   /* [2 * n_layer * PP_N_PROJ]: A's and B's borrowed bytes until finalize */
    struct ggml_context *meta;
    ggml_backend_buffer_t buffer;   /* every A and B, after finalize */
    int32_t              n_pairs;
    int                  finalized;
};

static atomic_uint_fast64_t next_uid = 1;

/* The GGUF names of a decoder layer's projections, by enum pp_projection. */
static const char *const PROJ_NAMES[PP_N_PROJ] = {
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
};

int32_t pp_lora_create(const pp_model *model, float alpha, pp_lora **out) {
    if (!model || !out) return pp_fail(PP_ERR_INVALID, "pp_lora_create: NULL argument");
    *out = NULL;
    if (!model->finalized) return pp_fail(PP_ERR_INVALID, "pp_lora_create: the base model is not finalized");
    if (model->hp.arch == PP_ARCH_BERT)
        return pp_fail(PP_ERR_INVALID, "LoRA adapters apply to decoder models, not to an encoder");
    if (model->hp.arch == PP_ARCH_GEMMA4)   /* its graph (gemma4_graph.c) adds no adapter's products */
        return pp_fail(PP_ERR_INVALID, "LoRA adapters are not supported for gemma4 models yet");
    if (!isfinite(alpha)) return pp_fail(PP_ERR_INVALID, "adapter.lora.alpha %g is not finite", (double)alpha);
    const size_t n_slots = (size_t)model->hp.n_layer * PP_N_PROJ;
    pp_lora *l = calloc(1, sizeof *l);
    if (l) {
        l->pairs = calloc(n_slots, sizeof *l->pairs);
        l->sources = calloc(2 * n_slots, sizeof *l->sources);
        struct ggml_init_params params = {.mem_size = 2 * n_slots * ggml_tensor_overhead(), .no_alloc = true};
        l->meta = ggml_init(params);
    }
    if (!l || !l->pairs || !l->sources || !l->meta) {
        pp_lora_destroy(l);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate an adapter's tables");
    }
    l->model = model;
    l->alpha = alpha;
    l->uid = atomic_fetch_add(&next_uid, 1);
    *out = l;
    return PP_OK;
}

void pp_lora_destroy(pp_lora *l) {
    if (!l) return;
    if (l->buffer) ggml_backend_buffer_free(l->buffer);
    if (l->meta) ggml_free(l->meta);
    free(l->pairs);
    free(l->sources);
    free(l);
}

static int ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* Layer and projection of "blk.<il>.<projection>.weight" (the name without
 * its .lora_a/.lora_b), or -1 for any other name. */
static int parse_target(const pp_model *m, const char *name, size_t len, int *il, int *proj) {
    const char *p = NULL;
    const int32_t layer = pp_tensor_layer(name, m->hp.n_layer, &p);
    if (layer < 0 || (size_t)(p - name) > len) return -1;
    const size_t rest = len - (size_t)(p - name);
    /* adapters reach attention and the dense FFN; the later slots (a delta-net layer's, a
     * shared expert's, a dense FFN beside experts) are panels' alone */
    for (int k = 0; k <= PP_PROJ_DOWN; k++)
        if (strlen(PROJ_NAMES[k]) == rest && !strncmp(p, PROJ_NAMES[k], rest)) {
            *il = (int)layer;
            *proj = k;
            return 0;
        }
    return -1;
}

/* [in, out] of layer il's projection proj in the base model (GGML order). */
static void base_shape(const pp_model *m, int proj, int64_t *in, int64_t *out) {
    const pp_model_hparams *hp = &m->hp;
    const int64_t q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    const int64_t ins[PP_N_PROJ] = {hp->n_embd, hp->n_embd, hp->n_embd, q_dim, hp->n_embd, hp->n_embd, hp->n_ff};
    const int64_t outs[PP_N_PROJ] = {q_dim, kv_dim, kv_dim, hp->n_embd, hp->n_ff, hp->n_ff, hp->n_embd};
    *in = ins[proj];
    *out = outs[proj];
}

/* The checks one matrix of a pair passes alone: 2-D, a type GGML multiplies
 * on the CPU, whole blocks per row, the byte count its shape takes. */
static int32_t check_matrix(const char *name, int32_t type, const int64_t *ne, int32_t n_dims, int64_t n_bytes) {
    if (n_dims < 1 || n_dims > GGML_MAX_DIMS)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': %d dimensions", name, n_dims);
    for (int d = 2; d < n_dims; d++)
        if (ne[d] != 1) return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': not a matrix", name);
    const int64_t ne1 = n_dims > 1 ? ne[1] : 1;
    if (ne[0] < 1 || ne1 < 1) return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': empty shape", name);
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type)type) == 0 ||
        ggml_type_size((enum ggml_type)type) == 0 || !ggml_get_type_traits_cpu((enum ggml_type)type)->vec_dot)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': ggml type %d has no CPU matrix multiplication", name, type);
    if (ne[0] % ggml_blck_size((enum ggml_type)type) != 0)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': row of %lld is not whole %s blocks", name,
                       (long long)ne[0], ggml_type_name((enum ggml_type)type));
    const size_t want = ggml_row_size((enum ggml_type)type, ne[0]) * (size_t)ne1;
    if (n_bytes < 0 || (size_t)n_bytes != want)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': %lld bytes given, but %s of this shape takes %zu", name,
                       (long long)n_bytes, ggml_type_name((enum ggml_type)type), want);
    return PP_OK;
}

int32_t pp_lora_set_tensor(pp_lora *l, const char *name, int32_t type, const int64_t *ne, int32_t n_dims,
                           const void *data, int64_t n_bytes) {
    if (!l || !name || !ne || !data) return pp_fail(PP_ERR_INVALID, "pp_lora_set_tensor: NULL argument");
    if (l->finalized) return pp_fail(PP_ERR_INVALID, "pp_lora_set_tensor: the adapter is finalized");
    const int is_a = ends_with(name, ".lora_a"), is_b = ends_with(name, ".lora_b");
    /* mergekit's extracted adapters carry norm vectors; llama.cpp ignores them too */
    if (!is_a && !is_b && ends_with(name, "_norm.weight")) return PP_OK;
    if (!is_a && !is_b)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': neither .lora_a nor .lora_b", name);
    int il = -1, proj = -1;
    const size_t base_len = strlen(name) - strlen(".lora_a");
    if (parse_target(l->model, name, base_len, &il, &proj) != 0)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': its base '%.*s' is not an attention or dense FFN "
                       "projection of this model's %d layers (a wrong base model?)", name, (int)base_len, name,
                       l->model->hp.n_layer);
    if (proj >= PP_PROJ_GATE && !pp_layer_weight(&l->model->layers[il], proj))
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': layer %d has routed experts, which adapters "
                       "cannot change here", name, il);
    int32_t st = check_matrix(name, type, ne, n_dims, n_bytes);
    if (st != PP_OK) return st;
    pp_lora_pair *pair = &l->pairs[(size_t)il * PP_N_PROJ + proj];
    if (is_a ? pair->a != NULL : pair->b != NULL) return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s' given twice", name);
    int64_t in, out;
    base_shape(l->model, proj, &in, &out);
    const int64_t ne1 = n_dims > 1 ? ne[1] : 1;
    /* A: [in, rank]; B: [rank, out] */
    if (is_a ? ne[0] != in : ne1 != out)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': shape [%lld, %lld] does not fit the base's [%lld, %lld] "
                       "(a wrong base model?)", name, (long long)ne[0], (long long)ne1, (long long)in, (long long)out);
    const int64_t rank = is_a ? ne1 : ne[0];
    if (rank > in || rank > out)
        return pp_fail(PP_ERR_INVALID, "LoRA tensor '%s': rank %lld above the projection's sides [%lld, %lld]", name,
                       (long long)rank, (long long)in, (long long)out);
    struct ggml_tensor *t = ggml_new_tensor_2d(l->meta, (enum ggml_type)type, ne[0], ne1);
    if (!t) return pp_fail(PP_ERR_NO_MEMORY, "LoRA tensor '%s': no room for metadata", name);
    ggml_set_name(t, name);
    const size_t slot = (size_t)il * PP_N_PROJ + proj;
    l->sources[2 * slot + (is_a ? 0 : 1)] = data;
    if (is_a) pair->a = t; else pair->b = t;
    return PP_OK;
}

/* Each pair complete and of one rank; its factor set. */
static int32_t check_pairs(pp_lora *l) {
    l->n_pairs = 0;
    for (int il = 0; il < l->model->hp.n_layer; il++)
        for (int k = 0; k < PP_N_PROJ; k++) {
            pp_lora_pair *pair = &l->pairs[(size_t)il * PP_N_PROJ + k];
            if (!pair->a && !pair->b) continue;
            if (!pair->a || !pair->b)
                return pp_fail(PP_ERR_INVALID, "LoRA pair for 'blk.%d.%s' lacks its %s", il, PROJ_NAMES[k],
                               pair->a ? "lora_b" : "lora_a");
            if (pair->a->ne[1] != pair->b->ne[0])
                return pp_fail(PP_ERR_INVALID, "LoRA pair for 'blk.%d.%s': lora_a has rank %lld but lora_b %lld "
                               "(lora_a not transposed?)", il, PROJ_NAMES[k], (long long)pair->a->ne[1],
                               (long long)pair->b->ne[0]);
            const float rank = (float)pair->a->ne[1];
            pair->factor = l->alpha != 0.0f ? l->alpha / rank : 1.0f;
            l->n_pairs++;
        }
    if (l->n_pairs == 0) return pp_fail(PP_ERR_INVALID, "the adapter holds no lora_a/lora_b pair");
    return PP_OK;
}

int32_t pp_lora_finalize(pp_lora *l) {
    if (!l) return pp_fail(PP_ERR_INVALID, "pp_lora_finalize: adapter is NULL");
    if (l->finalized) return pp_fail(PP_ERR_INVALID, "pp_lora_finalize: called twice");
    int32_t st = check_pairs(l);
    if (st != PP_OK) return st;
    /* host memory, also for a model on a device: GGML's scheduler runs a product where its weight is */
    l->buffer = ggml_backend_alloc_ctx_tensors_from_buft(l->meta, ggml_backend_cpu_buffer_type());
    if (!l->buffer) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the adapter's %d weight pairs", l->n_pairs);
    for (size_t slot = 0; slot < (size_t)l->model->hp.n_layer * PP_N_PROJ; slot++) {
        const pp_lora_pair *pair = &l->pairs[slot];
        if (!pair->a) continue;
        ggml_backend_tensor_set(pair->a, l->sources[2 * slot], 0, ggml_nbytes(pair->a));
        ggml_backend_tensor_set(pair->b, l->sources[2 * slot + 1], 0, ggml_nbytes(pair->b));
    }
    memset(l->sources, 0, sizeof *l->sources * 2 * (size_t)l->model->hp.n_layer * PP_N_PROJ);
    l->finalized = 1;
    return PP_OK;
}

int32_t pp_lora_n_pairs(const pp_lora *l) { return l ? l->n_pairs : 0; }

int64_t pp_lora_bytes(const pp_lora *l) {
    return l && l->buffer ? (int64_t)ggml_backend_buffer_get_size(l->buffer) : 0;
}

const pp_lora_pair *pp_lora_pair_of(const pp_lora *l, int il, int proj) {
    const pp_lora_pair *pair = &l->pairs[(size_t)il * PP_N_PROJ + proj];
    return pair->a ? pair : NULL;
}

uint64_t pp_lora_uid(const pp_lora *l) { return l->uid; }

const pp_model *pp_lora_model(const pp_lora *l) { return l->model; }

int pp_lora_is_final(const pp_lora *l) { return l->finalized; }
