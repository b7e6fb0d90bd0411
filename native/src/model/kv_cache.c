/* KV pools: one K and one V tensor of token rows per layer of a group,
 * indexed by slot (physical block id * block_size + offset); the layers of
 * different groups at the same index share a tensor, a block holding the KV
 * of the group it was taken for (see pp_kv_cache_create_grouped). Each token row holds all KV
 * heads, so a quantized row is whole quantization groups along the head
 * dimension and a page never shares a group with another page. */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

/* Whether layer il keeps K/V (a hybrid's recurrent layers keep a state slot instead). */
static int attends(const pp_model *m, int il) { return !m->layer_recurrent || !m->layer_recurrent[il]; }

/* Check the grouping and give each attention layer its index inside its group (-1: a
 * recurrent layer, which owns no pool). */
static int group_layers(const pp_model *m, int32_t n_groups, const int32_t *layer_group, int32_t *index,
                        int32_t *per_group) {
    const int n_layer = m->hp.n_layer;
    if (n_groups < 1 || n_groups > n_layer - m->n_recurrent || !layer_group)
        return pp_fail(PP_ERR_INVALID, "KV cache: %d layer groups for %d attention layers", n_groups,
                       n_layer - m->n_recurrent);
    int32_t count[256] = {0};
    if (n_groups > 256) return pp_fail(PP_ERR_INVALID, "KV cache: at most 256 layer groups, got %d", n_groups);
    for (int il = 0; il < n_layer; il++) {
        index[il] = -1;
        if (!attends(m, il)) continue;
        const int32_t g = layer_group[il];
        if (g < 0 || g >= n_groups)
            return pp_fail(PP_ERR_INVALID, "KV cache: layer %d in group %d, outside [0, %d)", il, g, n_groups);
        index[il] = count[g]++;
    }
    for (int32_t g = 1; g < n_groups; g++)
        if (count[g] != count[0])
            return pp_fail(PP_ERR_INVALID, "KV cache: group %d has %d layers, group 0 has %d (groups share "
                           "pools layer by layer, so they must be the same size)", g, count[g], count[0]);
    *per_group = count[0];
    return PP_OK;
}

int32_t pp_kv_cache_create_grouped(const pp_model *m, int32_t kv_type, int32_t num_blocks,
                                   int32_t block_size, int32_t paged, int32_t n_groups,
                                   const int32_t *layer_group, pp_kv_cache **out) {
    if (!m || !out) return pp_fail(PP_ERR_INVALID, "pp_kv_cache_create_grouped: NULL argument");
    *out = NULL;
    enum ggml_type type = (enum ggml_type)kv_type;
    if (type != GGML_TYPE_F16 && type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0)
        return pp_fail(PP_ERR_INVALID, "KV cache type %d unsupported: use f16, q8_0 or q4_0", kv_type);
    if (num_blocks < 1 || block_size < 1)
        return pp_fail(PP_ERR_INVALID, "KV cache needs num_blocks >= 1 and block_size >= 1 (got %d, %d)",
                       num_blocks, block_size);
    if (!paged && n_groups != 1)
        return pp_fail(PP_ERR_INVALID, "KV cache: slabs (paged=0) keep every layer: one group, got %d", n_groups);
    const int64_t head_dim = m->hp.head_dim;
    if (head_dim % ggml_blck_size(type) != 0)
        return pp_fail(PP_ERR_INVALID, "KV cache type %s quantizes groups of %lld values; head size %lld "
                       "is not a whole number of groups", ggml_type_name(type),
                       (long long)ggml_blck_size(type), (long long)head_dim);
    const int n_layer = m->hp.n_layer;
    pp_kv_cache *c = calloc(1, sizeof *c);
    if (!c) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the KV cache");
    c->model = m;
    c->type = type;
    c->num_blocks = num_blocks;
    c->block_size = block_size;
    c->paged = paged;
    c->n_groups = n_groups;
    c->num_slots = (int64_t)num_blocks * block_size;
    c->k = calloc((size_t)n_layer, sizeof *c->k);
    c->v = calloc((size_t)n_layer, sizeof *c->v);
    c->kt = calloc((size_t)n_layer, sizeof *c->kt);
    c->vt = calloc((size_t)n_layer, sizeof *c->vt);
    c->layer_group = malloc((size_t)n_layer * sizeof(int32_t));
    int32_t *index = malloc((size_t)n_layer * sizeof(int32_t));
    struct ggml_init_params params = {
        .mem_size = (size_t)(2 * n_layer + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    c->meta = ggml_init(params);
    ggml_backend_dev_t device = pp_model_device(m);
    if (device) c->device_meta = ggml_init(params);
    if (!c->k || !c->v || !c->kt || !c->vt || !c->layer_group || !index || !c->meta ||
        (device && !c->device_meta)) {
        free(index);
        pp_kv_cache_destroy(c);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the KV cache tables");
    }
    int st = group_layers(m, n_groups, layer_group, index, &c->layers_per_group);
    if (st != PP_OK) {
        free(index);
        pp_kv_cache_destroy(c);
        return st;
    }
    for (int il = 0; il < n_layer; il++) c->layer_group[il] = attends(m, il) ? layer_group[il] : 0;
    const int64_t n_embd_kv = head_dim * m->hp.n_head_kv;
    int n_device_pools = 0;
    for (int j = 0; j < c->layers_per_group; j++) {
        /* A pool lives where every layer sharing it runs; one read by a CPU
         * layer stays in host memory for our operator. */
        int on_device = device != NULL;
        for (int il = 0; il < n_layer; il++)
            if (index[il] == j && !pp_layer_on_device(m, il)) on_device = 0;
        struct ggml_context *where = on_device ? c->device_meta : c->meta;
        n_device_pools += on_device;
        c->kt[j] = ggml_new_tensor_2d(where, type, n_embd_kv, c->num_slots);
        c->row_bytes = c->kt[j]->nb[1];
        c->vt[j] = ggml_new_tensor_2d(where, type, n_embd_kv, c->num_slots);
        ggml_format_name(c->kt[j], "cache_k_%d", j);
        ggml_format_name(c->vt[j], "cache_v_%d", j);
    }
    for (int il = 0; il < n_layer; il++) {
        c->k[il] = index[il] >= 0 ? c->kt[index[il]] : NULL;
        c->v[il] = index[il] >= 0 ? c->vt[index[il]] : NULL;
    }
    free(index);
    const size_t pool_bytes = 2 * ggml_row_size(type, n_embd_kv) * (size_t)c->num_slots;
    /* A device binds one pool per op: one above its limit (a software Vulkan
     * device takes 128 MiB) would abort inside GGML's scheduler, so it is refused here. */
    if (n_device_pools > 0 && !ggml_backend_dev_supports_op(device, c->kt[0])) {
        pp_kv_cache_destroy(c);
        return pp_fail(PP_ERR_INVALID, "device %s cannot hold a KV pool of %.1f MiB (one layer's K for %lld "
                       "tokens) in one tensor: use a smaller KV budget or fewer GPU layers",
                       ggml_backend_dev_name(device), pool_bytes / 2 / 1048576.0, (long long)c->num_slots);
    }
    if (n_device_pools > 0) {
        c->device_buffer = ggml_backend_alloc_ctx_tensors_from_buft(c->device_meta,
                                                                    ggml_backend_dev_buffer_type(device));
        if (!c->device_buffer) {
            pp_kv_cache_destroy(c);
            return pp_fail(PP_ERR_NO_MEMORY, "device %s: cannot allocate KV pools of %.1f MiB (%lld tokens)",
                           ggml_backend_dev_name(device), n_device_pools * pool_bytes / 1048576.0,
                           (long long)num_blocks * block_size);
        }
        ggml_backend_buffer_clear(c->device_buffer, 0);
    }
    if (n_device_pools < c->layers_per_group) {
        c->buffer = ggml_backend_alloc_ctx_tensors_from_buft(c->meta, ggml_backend_cpu_buffer_type());
        if (!c->buffer) {
            pp_kv_cache_destroy(c);
            return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate KV pools of %lld tokens x %lld bytes",
                           (long long)num_blocks * block_size,
                           (long long)(2 * c->layers_per_group * ggml_row_size(type, n_embd_kv)));
        }
        /* Zeroed pools keep never-written slots finite if a bug ever reads them. */
        ggml_backend_buffer_clear(c->buffer, 0);
    }
    *out = c;
    return PP_OK;
}

void pp_kv_cache_destroy(pp_kv_cache *c) {
    if (!c) return;
    if (c->buffer) ggml_backend_buffer_free(c->buffer);
    if (c->device_buffer) ggml_backend_buffer_free(c->device_buffer);
    if (c->meta) ggml_free(c->meta);
    if (c->device_meta) ggml_free(c->device_meta);
    free(c->k);
    free(c->v);
    free(c->kt);
    free(c->vt);
    free(c->layer_group);
    free(c);
}

int64_t pp_kv_cache_bytes_per_token(const pp_kv_cache *c) {
    if (!c) return 0;
    return 2 * (int64_t)c->layers_per_group * c->n_groups * (int64_t)c->row_bytes;
}

int64_t pp_kv_cache_bytes_per_slot(const pp_kv_cache *c) {
    if (!c) return 0;
    return 2 * (int64_t)c->layers_per_group * (int64_t)c->row_bytes;
}

static size_t block_bytes(const pp_kv_cache *c) { return c->row_bytes * (size_t)c->block_size; }

/* One block of a pool to another block of it: a memcpy in host memory, a
 * read and a write through GGML's backend API on a device. */
static void copy_block(struct ggml_tensor *pool, size_t bytes, int32_t src, int32_t dst, void *staging) {
    if (ggml_backend_buffer_is_host(pool->buffer)) {
        memcpy((char *)pool->data + dst * bytes, (char *)pool->data + src * bytes, bytes);
        return;
    }
    ggml_backend_tensor_get(pool, staging, src * bytes, bytes);
    ggml_backend_tensor_set(pool, staging, dst * bytes, bytes);
}

int32_t pp_kv_cache_copy_blocks(pp_kv_cache *c, const pp_block_copy *copies, int32_t n) {
    if (!c || (n > 0 && !copies)) return pp_fail(PP_ERR_INVALID, "pp_kv_cache_copy_blocks: NULL argument");
    for (int32_t i = 0; i < n; i++)
        if (copies[i].src < 0 || copies[i].src >= c->num_blocks || copies[i].dst < 0 ||
            copies[i].dst >= c->num_blocks || copies[i].src == copies[i].dst)
            return pp_fail(PP_ERR_INVALID, "block copy %d -> %d invalid for %d blocks",
                           copies[i].src, copies[i].dst, c->num_blocks);
    const size_t bytes = block_bytes(c);
    void *staging = NULL;
    if (c->device_buffer && n > 0 && !(staging = malloc(bytes)))
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a block's staging buffer");
    for (int j = 0; j < c->layers_per_group; j++) {
        for (int32_t i = 0; i < n; i++) {
            copy_block(c->kt[j], bytes, copies[i].src, copies[i].dst, staging);
            copy_block(c->vt[j], bytes, copies[i].src, copies[i].dst, staging);
        }
    }
    free(staging);
    return PP_OK;
}

/* GGML's tensor get/set: a memcpy for host pools, a transfer for device ones. */
static int transfer_block(pp_kv_cache *c, int32_t block_id, char *host, int to_host) {
    if (!c || !host) return pp_fail(PP_ERR_INVALID, "KV block transfer: NULL argument");
    if (block_id < 0 || block_id >= c->num_blocks)
        return pp_fail(PP_ERR_INVALID, "block id %d out of range [0, %d)", block_id, c->num_blocks);
    const size_t bytes = block_bytes(c), offset = block_id * bytes;
    for (int j = 0; j < c->layers_per_group; j++) {
        if (to_host) {
            ggml_backend_tensor_get(c->kt[j], host, offset, bytes);
            ggml_backend_tensor_get(c->vt[j], host + bytes, offset, bytes);
        } else {
            ggml_backend_tensor_set(c->kt[j], host, offset, bytes);
            ggml_backend_tensor_set(c->vt[j], host + bytes, offset, bytes);
        }
        host += 2 * bytes;
    }
    return PP_OK;
}

int32_t pp_kv_cache_read_block(const pp_kv_cache *c, int32_t block_id, void *dst) {
    return transfer_block((pp_kv_cache *)c, block_id, dst, 1);
}

int32_t pp_kv_cache_write_block(pp_kv_cache *c, int32_t block_id, const void *src) {
    return transfer_block(c, block_id, (char *)src, 0);
}

int32_t pp_kv_cache_device_layers(const pp_kv_cache *c) {
    if (!c) return 0;
    int32_t n = 0;
    for (int il = 0; il < c->model->hp.n_layer; il++)
        n += c->k[il] && pp_pool_on_device(c, c->k[il]);
    return n;
}
