/* A vision projector's weights: its hyper-parameters checked, each GGUF
 * tensor name resolved to its slot and shape, the compute context made
 * with it (a CPU backend and thread pool of its own, as an encoder's). */
#include "vision/vision_internal.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A name, the slot it fills and its GGML shape (ne1 = 0: 1-D; ne3 = 0: at most 2-D). */
typedef struct vision_slot {
    const char *name;
    struct ggml_tensor **slot;
    int64_t ne[4];
} vision_slot;

enum { GLOBAL_SLOTS = 7, LAYER_SLOTS = 16 };

static void globals(pp_vision *v, vision_slot *s) {
    const pp_vision_hparams *hp = &v->hp;
    const int64_t d = hp->n_embd, p = hp->patch_size, side = pp_vision_side(hp);
    vision_slot t[GLOBAL_SLOTS] = {
        {"v.patch_embd.weight", &v->patch_w, {p, p, 3, d}},
        {"v.patch_embd.bias", &v->patch_b, {d}},
        {"v.position_embd.weight", &v->pos, {d, side * side}},
        {"v.post_ln.weight", &v->post_w, {d}},
        {"v.post_ln.bias", &v->post_b, {d}},
        {"mm.soft_emb_norm.weight", &v->soft_norm_w, {d}},
        {"mm.input_projection.weight", &v->proj_w, {hp->projection_dim, d}},
    };
    memcpy(s, t, sizeof t);
}

static void layer(const pp_vision_hparams *hp, pp_vision_layer *L, vision_slot *s) {
    const int64_t d = hp->n_embd, f = hp->n_ff;
    vision_slot t[LAYER_SLOTS] = {
        {"ln1.weight", &L->ln1_w, {d}},      {"ln1.bias", &L->ln1_b, {d}},
        {"ln2.weight", &L->ln2_w, {d}},      {"ln2.bias", &L->ln2_b, {d}},
        {"attn_q.weight", &L->q_w, {d, d}},  {"attn_q.bias", &L->q_b, {d}},
        {"attn_k.weight", &L->k_w, {d, d}},  {"attn_k.bias", &L->k_b, {d}},
        {"attn_v.weight", &L->v_w, {d, d}},  {"attn_v.bias", &L->v_b, {d}},
        {"attn_out.weight", &L->o_w, {d, d}}, {"attn_out.bias", &L->o_b, {d}},
        {"ffn_up.weight", &L->up_w, {d, f}}, {"ffn_up.bias", &L->up_b, {f}},
        {"ffn_down.weight", &L->down_w, {f, d}}, {"ffn_down.bias", &L->down_b, {d}},
    };
    memcpy(s, t, sizeof t);
}

/* The slot of name into *out, or 0 for a name the encoder does not use. The
 * layer number is parsed by hand: sscanf's %d overflows on a fuzzed name. */
static int resolve(pp_vision *v, const char *name, vision_slot *out) {
    vision_slot s[LAYER_SLOTS];
    globals(v, s);
    for (int i = 0; i < GLOBAL_SLOTS; i++)
        if (!strcmp(name, s[i].name)) return *out = s[i], 1;
    if (strncmp(name, "v.blk.", 6) != 0) return 0;
    const char *c = name + 6;
    int64_t il = 0;
    if (*c < '0' || *c > '9') return 0;
    for (; *c >= '0' && *c <= '9'; c++)
        if ((il = il * 10 + (*c - '0')) >= v->hp.n_layer) return 0;
    if (*c++ != '.') return 0;
    layer(&v->hp, &v->layers[il], s);
    for (int i = 0; i < LAYER_SLOTS; i++)
        if (!strcmp(c, s[i].name)) return *out = s[i], 1;
    return 0;
}

static int32_t check_hparams(const pp_vision_hparams *hp) {
    if (hp->projector != PP_PROJECTOR_GEMMA3) return pp_fail(PP_ERR_INVALID, "projector type %d unknown", hp->projector);
    if (hp->n_layer < 1 || hp->n_layer > 1024 || hp->n_embd < 1 || hp->n_head < 1 || hp->n_embd % hp->n_head ||
        hp->n_ff < 1 || hp->projection_dim < 1 || !(hp->eps > 0.0f))
        return pp_fail(PP_ERR_INVALID, "vision hyper-parameters out of range (n_layer %d, n_embd %d, n_head %d, "
                       "n_ff %d, projection_dim %d)", hp->n_layer, hp->n_embd, hp->n_head, hp->n_ff, hp->projection_dim);
    if (hp->patch_size < 1 || hp->image_size < hp->patch_size || hp->image_size % hp->patch_size ||
        hp->image_size > 8192 || hp->scale_factor < 1 || pp_vision_side(hp) % hp->scale_factor)
        return pp_fail(PP_ERR_INVALID, "image_size %d must be a multiple of patch_size %d, its grid of scale_factor %d",
                       hp->image_size, hp->patch_size, hp->scale_factor);
    return PP_OK;
}

void pp_vision_destroy(pp_vision *v) {
    if (!v) return;
    pp_cpu_compute_release(&v->compute);
    if (v->weights) ggml_free(v->weights);
    free(v->layers);
    free(v);
}

int32_t pp_vision_create(const pp_vision_hparams *hp, int32_t n_threads, pp_vision **out) {
    if (!hp || !out) return pp_fail(PP_ERR_INVALID, "pp_vision_create: NULL argument");
    *out = NULL;
    int32_t st = check_hparams(hp);
    if (st != PP_OK) return st;
    if (n_threads < 1 || n_threads > GGML_MAX_N_THREADS)
        return pp_fail(PP_ERR_INVALID, "n_threads must be in [1, %d], got %d", GGML_MAX_N_THREADS, n_threads);
    pp_vision *v = calloc(1, sizeof *v);
    if (!v) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a vision encoder");
    v->hp = *hp;
    v->layers = calloc((size_t)hp->n_layer, sizeof *v->layers);
    const size_t n_tensors = GLOBAL_SLOTS + (size_t)LAYER_SLOTS * hp->n_layer;
    struct ggml_init_params wp = {.mem_size = ggml_tensor_overhead() * n_tensors, .mem_buffer = NULL, .no_alloc = true};
    v->weights = ggml_init(wp);
    if (!v->layers || !v->weights) {
        pp_vision_destroy(v);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot set up the vision encoder");
    }
    /* its own pool, sleeping between images: the CPU then belongs to the decoder */
    st = pp_cpu_compute_init(&v->compute, n_threads, pp_vision_graph_nodes(hp->n_layer));
    if (st != PP_OK) {
        pp_vision_destroy(v);
        return st;
    }
    *out = v;
    return PP_OK;
}

/* Norms, biases and the position embedding meet f32 activations in ggml_add
 * and ggml_mul (f32 only); matrices feed ggml_mul_mat (a CPU dot product). */
static int32_t check_type(const char *name, int32_t type, const vision_slot *s) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type)type) == 0 ||
        ggml_type_size((enum ggml_type)type) == 0)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': unsupported ggml type %d", name, type);
    const int matrix = s->ne[1] != 0 && strcmp(name, "v.position_embd.weight") != 0;
    if (!matrix && type != GGML_TYPE_F32)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s, but norms, biases and positions must be f32", name,
                       ggml_type_name((enum ggml_type)type));
    /* the kernel is multiplied as [3 * p * p, n_embd] rows, which must not split a quant block, and
     * the projection is transposed in the graph (as llama.cpp does), which a quant block cannot be */
    if ((!strcmp(name, "v.patch_embd.weight") || !strcmp(name, "mm.input_projection.weight")) &&
        type != GGML_TYPE_F32 && type != GGML_TYPE_F16)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s, but it must be f32 or f16", name,
                       ggml_type_name((enum ggml_type)type));
    if (matrix && !ggml_get_type_traits_cpu((enum ggml_type)type)->vec_dot)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': type %s has no CPU matrix multiplication", name,
                       ggml_type_name((enum ggml_type)type));
    return PP_OK;
}

int32_t pp_vision_set_tensor(pp_vision *v, const char *name, int32_t type, const int64_t *ne, int32_t n_dims,
                             const void *data, int64_t n_bytes, int32_t *used) {
    if (!v || !name || !ne || !data) return pp_fail(PP_ERR_INVALID, "pp_vision_set_tensor: NULL argument");
    if (used) *used = 0;
    if (v->finalized) return pp_fail(PP_ERR_INVALID, "tensor '%s': the vision encoder is finalized", name);
    if (n_dims < 1 || n_dims > GGML_MAX_DIMS)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': %d dimensions (GGML takes 1 to %d)", name, n_dims, GGML_MAX_DIMS);
    vision_slot s;
    if (!resolve(v, name, &s)) return PP_OK;
    for (int d = 0; d < GGML_MAX_DIMS; d++) {
        const int64_t want = s.ne[d] ? s.ne[d] : 1, got = d < n_dims ? ne[d] : 1;
        if (got != want)
            return pp_fail(PP_ERR_INVALID, "tensor '%s': dimension %d is %lld, the hyper-parameters need %lld", name, d,
                           (long long)got, (long long)want);
    }
    int32_t st = check_type(name, type, &s);
    if (st != PP_OK) return st;
    if (ne[0] % ggml_blck_size((enum ggml_type)type) != 0)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': row of %lld is not whole %s blocks", name, (long long)ne[0],
                       ggml_type_name((enum ggml_type)type));
    if (*s.slot) return pp_fail(PP_ERR_INVALID, "tensor '%s' given twice", name);
    struct ggml_tensor *t = ggml_new_tensor(v->weights, (enum ggml_type)type, 4, (const int64_t[4]){
        s.ne[0], s.ne[1] ? s.ne[1] : 1, s.ne[2] ? s.ne[2] : 1, s.ne[3] ? s.ne[3] : 1});
    if (!t) return pp_fail(PP_ERR_NO_MEMORY, "tensor '%s': no room for metadata", name);
    if (n_bytes < 0 || ggml_nbytes(t) != (size_t)n_bytes)
        return pp_fail(PP_ERR_INVALID, "tensor '%s': %lld bytes given, but %s of this shape takes %zu", name,
                       (long long)n_bytes, ggml_type_name((enum ggml_type)type), ggml_nbytes(t));
    ggml_set_name(t, name);
    t->data = (void *)data;
    *s.slot = t;
    if (used) *used = 1;
    return PP_OK;
}

int32_t pp_vision_finalize(pp_vision *v) {
    if (!v) return pp_fail(PP_ERR_INVALID, "pp_vision_finalize: NULL argument");
    vision_slot s[LAYER_SLOTS];
    globals(v, s);
    for (int i = 0; i < GLOBAL_SLOTS; i++)
        if (!*s[i].slot) return pp_fail(PP_ERR_INVALID, "missing tensor '%s'", s[i].name);
    for (int il = 0; il < v->hp.n_layer; il++) {
        layer(&v->hp, &v->layers[il], s);
        for (int i = 0; i < LAYER_SLOTS; i++)
            if (!*s[i].slot) return pp_fail(PP_ERR_INVALID, "missing tensor 'v.blk.%d.%s'", il, s[i].name);
    }
    v->finalized = 1;
    return PP_OK;
}

int32_t pp_vision_n_tokens(const pp_vision *v) {
    if (!v) return 0;
    const int side = pp_vision_side(&v->hp) / v->hp.scale_factor;
    return side * side;
}
