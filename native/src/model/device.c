/* GGML's devices and the weights placed on one of them. A model's last
 * decoder layers (and, with all of them, the output head) are copied into a
 * buffer of the device, as llama.cpp splits a model by n_gpu_layers: the
 * layers nearest the output run there, the token embedding stays on the
 * CPU (a row lookup, no product). The graph is the same; GGML's scheduler
 * runs each op where its weights live. */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <stdint.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int32_t pp_device_count(void) { return (int32_t)ggml_backend_dev_count(); }

static ggml_backend_dev_t device_at(int32_t index) {
    if (index < 0 || (size_t)index >= ggml_backend_dev_count()) return NULL;
    return ggml_backend_dev_get((size_t)index);
}

int32_t pp_device_get(int32_t index, pp_device_info *out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_device_get: NULL argument");
    ggml_backend_dev_t dev = device_at(index);
    if (!dev)
        return pp_fail(PP_ERR_INVALID, "device %d does not exist (GGML lists %zu)", index, ggml_backend_dev_count());
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", ggml_backend_dev_name(dev));
    snprintf(out->description, sizeof out->description, "%s", ggml_backend_dev_description(dev));
    switch (ggml_backend_dev_type(dev)) {
    case GGML_BACKEND_DEVICE_TYPE_CPU: out->type = PP_DEVICE_CPU; break;
    case GGML_BACKEND_DEVICE_TYPE_GPU: out->type = PP_DEVICE_GPU; break;
    case GGML_BACKEND_DEVICE_TYPE_IGPU: out->type = PP_DEVICE_IGPU; break;
    default: out->type = PP_DEVICE_ACCEL; break;
    }
    size_t free_bytes = 0, total_bytes = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
    out->memory_free = (int64_t)free_bytes;
    out->memory_total = (int64_t)total_bytes;
    return PP_OK;
}

ggml_backend_dev_t pp_model_device(const pp_model *m) { return m->device < 0 ? NULL : device_at(m->device); }

/* The tensor slots a layer owns (NULL entries for what its architecture lacks). */
static int layer_tensors(pp_layer *L, struct ggml_tensor ***out) {
    struct ggml_tensor **slots[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk, &L->bv,
                                    &L->q_norm, &L->k_norm, &L->post_attn_norm, &L->ffn_norm, &L->ffn_gate,
                                    &L->ffn_up, &L->ffn_down, &L->post_ffw_norm, &L->ffn_gate_inp,
                                    &L->ffn_gate_exps, &L->ffn_up_exps, &L->ffn_down_exps, &L->bo,
                                    &L->attn_sinks, &L->ffn_gate_inp_b, &L->ffn_gate_exps_b, &L->ffn_up_exps_b,
                                    &L->ffn_down_exps_b, &L->out_scale, &L->per_layer_inp_gate, &L->per_layer_proj,
                                    &L->per_layer_post_norm, &L->ffn_gate_inp_s, &L->ffn_pre_norm_2,
                                    &L->ffn_post_norm_1, &L->ffn_post_norm_2, &L->ffn_gate_up_exps,
                                    &L->ffn_down_exps_s};
    const int n = (int)(sizeof slots / sizeof slots[0]);
    memcpy(out, slots, sizeof slots);
    return n;
}

#define MAX_LAYER_TENSORS 36
#define MAPPED_ALIGNMENT 64   /* GGML asks a host pointer wrapped in a buffer to be aligned */

/* The weights left in the caller's mapping get a CPU buffer over it: GGML's
 * scheduler knows a tensor's home by its buffer, and one without would be
 * handed to a device op as is instead of being copied there. */
static int wrap_mapped_weights(pp_model *m) {
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (struct ggml_tensor *t = ggml_get_first_tensor(m->weights); t; t = ggml_get_next_tensor(m->weights, t)) {
        if (t->buffer || !t->data) continue;
        if ((uintptr_t)t->data < lo) lo = (uintptr_t)t->data;
        if ((uintptr_t)t->data + ggml_nbytes(t) > hi) hi = (uintptr_t)t->data + ggml_nbytes(t);
    }
    if (hi == 0 || m->mapped_buffer) return PP_OK;
    lo &= ~(uintptr_t)(MAPPED_ALIGNMENT - 1);   /* never read below the first tensor: only a range */
    m->mapped_buffer = ggml_backend_cpu_buffer_from_ptr((void *)lo, hi - lo);
    if (!m->mapped_buffer) return pp_fail(PP_ERR_NO_MEMORY, "cannot describe the mapped weights to GGML");
    ggml_backend_buffer_set_usage(m->mapped_buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (struct ggml_tensor *t = ggml_get_first_tensor(m->weights); t; t = ggml_get_next_tensor(m->weights, t))
        if (!t->buffer && t->data) t->buffer = m->mapped_buffer;
    return PP_OK;
}

static void unwrap_mapped_weights(pp_model *m) {
    for (struct ggml_tensor *t = ggml_get_first_tensor(m->weights); t; t = ggml_get_next_tensor(m->weights, t))
        if (t->buffer == m->mapped_buffer) t->buffer = NULL;
    if (m->mapped_buffer) ggml_backend_buffer_free(m->mapped_buffer);
    m->mapped_buffer = NULL;
}

int32_t pp_model_offload(pp_model *m, int32_t device, int32_t n_layers, int32_t offload_output) {
    if (!m || !m->finalized) return pp_fail(PP_ERR_INVALID, "pp_model_offload: model missing or not finalized");
    if (m->hp.arch == PP_ARCH_BERT) return pp_fail(PP_ERR_INVALID, "an encoder-only model runs on the CPU only");
    /* their state pool lives in host memory, and nothing here has run their layers on a device */
    if (m->n_recurrent > 0 && (n_layers > 0 || offload_output))
        return pp_fail(PP_ERR_INVALID, "a hybrid model (Gated DeltaNet layers) runs on the CPU only for now");
    if (m->device >= 0) return pp_fail(PP_ERR_INVALID, "the model is already offloaded");
    if (m->panels || m->repack_done)
        return pp_fail(PP_ERR_INVALID, "offload before packing panels or repacking weights (they move weights)");
    ggml_backend_dev_t dev = device_at(device);
    if (!dev)
        return pp_fail(PP_ERR_INVALID, "device %d does not exist (GGML lists %zu)", device, ggml_backend_dev_count());
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU)
        return pp_fail(PP_ERR_INVALID, "device %d (%s) is the CPU: nothing to offload to", device,
                       ggml_backend_dev_name(dev));
    if (n_layers < 0) return pp_fail(PP_ERR_INVALID, "n_layers %d must be >= 0", n_layers);
    const int n_layer = m->hp.n_layer;
    const int first = n_layers >= n_layer ? 0 : n_layer - n_layers;
    /* A device may cap one tensor's size (a software Vulkan device binds at
     * most 128 MiB): a head above it stays on the CPU, a layer's weight
     * above it is an error. */
    struct ggml_tensor *head_source = m->output ? m->output : m->tok_embd;
    const int output = offload_output != 0 && ggml_backend_dev_supports_op(dev, head_source);
    for (int il = first; il < n_layer; il++) {
        struct ggml_tensor **layer[MAX_LAYER_TENSORS];
        const int k = layer_tensors(&m->layers[il], layer);
        for (int i = 0; i < k; i++)
            if (*layer[i] && !ggml_backend_dev_supports_op(dev, *layer[i]))
                return pp_fail(PP_ERR_INVALID, "device %s cannot hold tensor '%s' (%.1f MiB, type %s): offload "
                               "fewer layers", ggml_backend_dev_name(dev), (*layer[i])->name,
                               ggml_nbytes(*layer[i]) / 1048576.0, ggml_type_name((*layer[i])->type));
    }
    if (first == n_layer && !output) return PP_OK;

    /* Every tensor that moves, and where its pointer lives. */
    const size_t max_moves = (size_t)(n_layer - first) * MAX_LAYER_TENSORS + 2;
    struct ggml_tensor ***slots = malloc(max_moves * sizeof *slots);
    struct ggml_tensor **copies = malloc(max_moves * sizeof *copies);
    struct ggml_init_params params = {.mem_size = max_moves * ggml_tensor_overhead(), .mem_buffer = NULL,
                                      .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    if (!slots || !copies || !ctx || wrap_mapped_weights(m) != PP_OK) {
        free(slots);
        free(copies);
        if (ctx) ggml_free(ctx);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the offload tables");
    }
    int n = 0;
    for (int il = first; il < n_layer; il++) {
        struct ggml_tensor **layer[MAX_LAYER_TENSORS];
        const int k = layer_tensors(&m->layers[il], layer);
        for (int i = 0; i < k; i++)
            if (*layer[i]) slots[n++] = layer[i];
    }
    /* A tied head is the embedding: the device gets a copy as m->output and
     * the CPU keeps token_embd for the lookup. */
    if (output) {
        slots[n++] = &m->output_norm;
        slots[n++] = &m->output;
    }
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor *src = *slots[i] ? *slots[i] : head_source;
        copies[i] = ggml_dup_tensor(ctx, src);
        ggml_set_name(copies[i], src->name);
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    if (!buf) {
        unwrap_mapped_weights(m);
        size_t bytes = 0;
        for (int i = 0; i < n; i++) bytes += ggml_nbytes(copies[i]);
        free(slots);
        free(copies);
        ggml_free(ctx);
        return pp_fail(PP_ERR_NO_MEMORY, "device %s: cannot allocate %.1f MiB for the weights of %d layers%s",
                       ggml_backend_dev_name(dev), bytes / 1048576.0, n_layer - first,
                       output ? " and the output head" : "");
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor *src = *slots[i] ? *slots[i] : head_source;
        ggml_backend_tensor_set(copies[i], src->data, 0, ggml_nbytes(src));
        /* token_embd stays read on the CPU even when the device has its copy */
        if (src != m->tok_embd) pp_release_mapped(src->data, ggml_nbytes(src));
        *slots[i] = copies[i];
    }
    free(slots);
    free(copies);
    m->device = device;
    m->device_first_layer = first;
    m->device_output = output;
    m->device_weights = ctx;
    m->device_buffer = buf;
    return PP_OK;
}

int32_t pp_model_layer_device(const pp_model *m, int32_t il) {
    if (!m || il < 0 || il > m->hp.n_layer) return -1;
    return pp_layer_on_device(m, il) ? m->device : -1;
}

int64_t pp_model_device_bytes(const pp_model *m) {
    return m && m->device_buffer ? (int64_t)ggml_backend_buffer_get_size(m->device_buffer) : 0;
}
