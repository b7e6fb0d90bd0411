/* The recurrent state pool of a hybrid model: one slot per running sequence, each holding
 * every Gated DeltaNet layer's convolution state and delta-rule state in f32 (see
 * pyllama_paged.h). Per linear layer two tensors of num_slots rows, so a step's graph reads
 * its sequences' rows with ggml_get_rows and writes them back with ggml_set_rows by slot. */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

#define PP_MAX_STATE_SLOTS 1048576

int64_t pp_model_state_bytes(const pp_model *m) {
    if (!m || m->n_recurrent == 0) return 0;
    return (int64_t)m->n_recurrent * (pp_conv_state_floats(&m->hp) + pp_delta_state_floats(&m->hp)) * (int64_t)sizeof(float);
}

void pp_state_pool_destroy(pp_state_pool *p) {
    if (!p) return;
    if (p->buffer) ggml_backend_buffer_free(p->buffer);
    if (p->meta) ggml_free(p->meta);
    free(p->conv);
    free(p->delta);
    free(p->taken);
    free(p);
}

int32_t pp_state_pool_create(const pp_model *m, int32_t num_slots, pp_state_pool **out) {
    if (!m || !out) return pp_fail(PP_ERR_INVALID, "pp_state_pool_create: NULL argument");
    *out = NULL;
    if (m->n_recurrent == 0) return pp_fail(PP_ERR_INVALID, "the model has no recurrent layers: it needs no state pool");
    if (num_slots < 1 || num_slots > PP_MAX_STATE_SLOTS)
        return pp_fail(PP_ERR_INVALID, "state pool: %d slots outside [1, %d]", num_slots, PP_MAX_STATE_SLOTS);
    const int n_layer = m->hp.n_layer;
    pp_state_pool *p = calloc(1, sizeof *p);
    if (!p) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the state pool");
    p->model = m;
    p->num_slots = p->n_free = num_slots;
    p->bytes_per_slot = pp_model_state_bytes(m);
    p->conv = calloc((size_t)n_layer, sizeof *p->conv);
    p->delta = calloc((size_t)n_layer, sizeof *p->delta);
    p->taken = calloc((size_t)num_slots, 1);
    struct ggml_init_params params = {
        .mem_size = (size_t)(2 * m->n_recurrent + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    p->meta = ggml_init(params);
    if (!p->conv || !p->delta || !p->taken || !p->meta) {
        pp_state_pool_destroy(p);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the state pool's tables");
    }
    for (int il = 0; il < n_layer; il++) {
        if (!m->layer_recurrent[il]) continue;
        p->conv[il] = ggml_new_tensor_2d(p->meta, GGML_TYPE_F32, pp_conv_state_floats(&m->hp), num_slots);
        p->delta[il] = ggml_new_tensor_2d(p->meta, GGML_TYPE_F32, pp_delta_state_floats(&m->hp), num_slots);
        ggml_format_name(p->conv[il], "conv_state_%d", il);
        ggml_format_name(p->delta[il], "delta_state_%d", il);
    }
    p->buffer = ggml_backend_alloc_ctx_tensors_from_buft(p->meta, ggml_backend_cpu_buffer_type());
    if (!p->buffer) {
        const double mib = (double)p->bytes_per_slot * num_slots / 1048576.0;
        pp_state_pool_destroy(p);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a state pool of %d slots (%.1f MiB)", num_slots, mib);
    }
    ggml_backend_buffer_clear(p->buffer, 0);
    *out = p;
    return PP_OK;
}

/* PP_OK if slot is a taken slot of p, else PP_ERR_INVALID naming it. */
static int32_t check_taken(const pp_state_pool *p, int32_t slot) {
    if (!p) return pp_fail(PP_ERR_INVALID, "state pool is NULL");
    if (slot < 0 || slot >= p->num_slots)
        return pp_fail(PP_ERR_INVALID, "state slot %d out of range [0, %d)", slot, p->num_slots);
    if (!p->taken[slot]) return pp_fail(PP_ERR_INVALID, "state slot %d is not taken", slot);
    return PP_OK;
}

void pp_state_pool_zero_slot(pp_state_pool *p, int32_t slot) {
    for (int il = 0; il < p->model->hp.n_layer; il++) {
        if (!p->conv[il]) continue;
        memset((char *)p->conv[il]->data + (size_t)slot * p->conv[il]->nb[1], 0, p->conv[il]->nb[1]);
        memset((char *)p->delta[il]->data + (size_t)slot * p->delta[il]->nb[1], 0, p->delta[il]->nb[1]);
    }
}

int32_t pp_state_pool_alloc(pp_state_pool *p, int32_t *slot) {
    if (!p || !slot) return pp_fail(PP_ERR_INVALID, "pp_state_pool_alloc: NULL argument");
    if (p->n_free == 0)
        return pp_fail(PP_ERR_OUT_OF_BLOCKS, "all %d state slots are taken", p->num_slots);
    int32_t s = 0;
    while (p->taken[s]) s++;
    pp_state_pool_zero_slot(p, s);
    p->taken[s] = 1;
    p->n_free--;
    *slot = s;
    return PP_OK;
}

int32_t pp_state_pool_free(pp_state_pool *p, int32_t slot) {
    const int32_t st = check_taken(p, slot);
    if (st != PP_OK) return st;
    p->taken[slot] = 0;
    p->n_free++;
    return PP_OK;
}

int32_t pp_state_pool_zero(pp_state_pool *p, int32_t slot) {
    const int32_t st = check_taken(p, slot);
    if (st != PP_OK) return st;
    pp_state_pool_zero_slot(p, slot);
    return PP_OK;
}

int32_t pp_state_pool_copy(pp_state_pool *p, int32_t src, int32_t dst) {
    int32_t st = check_taken(p, src);
    if (st == PP_OK) st = check_taken(p, dst);
    if (st != PP_OK) return st;
    if (src == dst) return pp_fail(PP_ERR_INVALID, "state copy of slot %d onto itself", src);
    for (int il = 0; il < p->model->hp.n_layer; il++) {
        if (!p->conv[il]) continue;
        const size_t conv = p->conv[il]->nb[1], delta = p->delta[il]->nb[1];
        memcpy((char *)p->conv[il]->data + (size_t)dst * conv, (char *)p->conv[il]->data + (size_t)src * conv, conv);
        memcpy((char *)p->delta[il]->data + (size_t)dst * delta, (char *)p->delta[il]->data + (size_t)src * delta,
               delta);
    }
    return PP_OK;
}

/* A slot's bytes to or from host memory, layer by layer: convolution, then delta rule. */
static int32_t transfer(pp_state_pool *p, int32_t slot, char *host, int to_host) {
    const int32_t st = check_taken(p, slot);
    if (st != PP_OK) return st;
    if (!host) return pp_fail(PP_ERR_INVALID, "state transfer: NULL buffer");
    for (int il = 0; il < p->model->hp.n_layer; il++) {
        if (!p->conv[il]) continue;
        struct ggml_tensor *const parts[2] = {p->conv[il], p->delta[il]};
        for (int i = 0; i < 2; i++) {
            char *row = (char *)parts[i]->data + (size_t)slot * parts[i]->nb[1];
            if (to_host) memcpy(host, row, parts[i]->nb[1]);
            else memcpy(row, host, parts[i]->nb[1]);
            host += parts[i]->nb[1];
        }
    }
    return PP_OK;
}

int32_t pp_state_pool_read(const pp_state_pool *p, int32_t slot, void *dst) {
    return transfer((pp_state_pool *)p, slot, dst, 1);
}

int32_t pp_state_pool_write(pp_state_pool *p, int32_t slot, const void *src) {
    return transfer(p, slot, (char *)src, 0);
}

int64_t pp_state_pool_bytes_per_slot(const pp_state_pool *p) { return p ? p->bytes_per_slot : 0; }

int32_t pp_state_pool_num_slots(const pp_state_pool *p) { return p ? p->num_slots : 0; }

int32_t pp_state_pool_num_free(const pp_state_pool *p) { return p ? p->n_free : 0; }
