/* KV pools: one K and one V tensor of token rows per layer of a group,
 * indexed by slot (physical block id * block_size + offset); the layers of
 * different groups at the same index share a tensor, a block holding the KV
 * of the group it was taken for (see pp_kv_cache_create_grouped). Layers of
 * different row widths lie side by side in the slots of one pool instead
 * (pool_plan), and a layer that reads an earlier layer's KV has no rows of its
 * own. Each token row holds all KV heads, so a quantized row is whole
 * quantization groups along the head dimension and a page never shares a
 * group with another page. */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

/* Where each layer's K/V rows lie: pool[il] and, in values, offset[il] inside a slot's row of
 * that pool; width[p] values per slot of pool p. A layer that reads another's KV lies where
 * its source does. Layers of one row width in groups of one size keep the layout of uniform
 * models: the i-th layer of every group has pool i to itself, whole rows. Otherwise (Gemma 4's
 * sliding and full layers differ) one pool holds, in each slot, the layers of whichever group
 * took the block side by side, a slot as wide as the widest group's layers. */
typedef struct pool_plan {
    int32_t *pool;
    int64_t *offset;
    int64_t *width;
    int32_t  n_pools;
} pool_plan;

/* Whether layer il keeps K/V (a hybrid's recurrent layers keep a state slot instead). */
static int attends(const pp_model *m, int il) { return !m->layer_recurrent || !m->layer_recurrent[il]; }

/* Check the grouping (a shared-KV layer in its source's group) and plan the pools; a recurrent
 * layer has none (pool -1). */
static int plan_pools(const pp_model *m, int32_t n_groups, const int32_t *layer_group, pool_plan *plan) {
    const int n_layer = m->hp.n_layer, n_attention = n_layer - m->n_recurrent;
    if (n_groups < 1 || n_groups > n_attention || !layer_group)
        return pp_fail(PP_ERR_INVALID, "KV cache: %d layer groups for %d attention layers", n_groups, n_attention);
    if (n_groups > 256) return pp_fail(PP_ERR_INVALID, "KV cache: at most 256 layer groups, got %d", n_groups);
    int32_t count[256] = {0};
    int64_t used[256] = {0};
    int uniform = 1;
    for (int il = 0; il < n_layer; il++) {
        plan->pool[il] = -1;
        if (!attends(m, il)) continue;
        const int32_t g = layer_group[il], src = pp_layer_kv_source(m, il);
        if (g < 0 || g >= n_groups)
            return pp_fail(PP_ERR_INVALID, "KV cache: layer %d in group %d, outside [0, %d)", il, g, n_groups);
        if (src != il) {
            if (layer_group[src] != g)
                return pp_fail(PP_ERR_INVALID, "KV cache: layer %d reads layer %d's KV but is in group %d, not %d",
                               il, src, g, layer_group[src]);
            continue;
        }
        plan->pool[il] = count[g]++;
        plan->offset[il] = used[g];
        used[g] += pp_layer_n_embd_kv(m, il);
        uniform &= pp_layer_n_embd_kv(m, il) == pp_layer_n_embd_kv(m, 0);
    }
    for (int32_t g = 0; g < n_groups; g++) {
        if (count[g] == 0) return pp_fail(PP_ERR_INVALID, "KV cache: group %d holds no layer with KV of its own", g);
        uniform &= count[g] == count[0];
    }
    plan->n_pools = uniform ? count[0] : 1;
    for (int32_t p = 0; p < plan->n_pools; p++) plan->width[p] = 0;
    for (int il = 0; il < n_layer; il++) {
        const int32_t src = pp_layer_kv_source(m, il);
        if (src != il || !attends(m, il)) continue;
        if (uniform) {
            plan->offset[il] = 0;
            plan->width[plan->pool[il]] = pp_layer_n_embd_kv(m, il);
        } else {
            plan->pool[il] = 0;
            if (used[layer_group[il]] > plan->width[0]) plan->width[0] = used[layer_group[il]];
        }
    }
    for (int il = 0; il < n_layer; il++) {
        if (!attends(m, il)) continue;
        plan->pool[il] = plan->pool[pp_layer_kv_source(m, il)];
        plan->offset[il] = plan->offset[pp_layer_kv_source(m, il)];
    }
    return PP_OK;
}

/* Layer il's rows: its pool itself, or the view of its lane (in the pool's context). */
static struct ggml_tensor *layer_rows(struct ggml_context *ctx, struct ggml_tensor *pool, int64_t width,
                                      int64_t offset) {
    if (offset == 0 && width == pool->ne[0]) return pool;
    return ggml_view_2d(ctx, pool, width, pool->ne[1], pool->nb[1], ggml_row_size(pool->type, offset));
}

/* The planned pools and each layer's rows, allocated where they run: a pool lives on the
 * model's device when every layer reading it runs there (one read by a CPU layer stays in
 * host memory for our operator). */
static int make_pools(pp_kv_cache *c, const pool_plan *plan, ggml_backend_dev_t device) {
    const pp_model *m = c->model;
    const int n_layer = m->hp.n_layer;
    int n_device_pools = 0;
    int on_device[512];   /* per pool; n_pools <= n_layer <= 512 */
    struct ggml_tensor *device_pool = NULL;
    c->n_pools = plan->n_pools;
    for (int j = 0; j < plan->n_pools; j++) {
        on_device[j] = device != NULL;
        for (int il = 0; il < n_layer; il++)
            if (plan->pool[il] == j && !pp_layer_on_device(m, il)) on_device[j] = 0;
        struct ggml_context *where = on_device[j] ? c->device_meta : c->meta;
        n_device_pools += on_device[j];
        c->kt[j] = ggml_new_tensor_2d(where, c->type, plan->width[j], c->num_slots);
        c->vt[j] = ggml_new_tensor_2d(where, c->type, plan->width[j], c->num_slots);
        ggml_format_name(c->kt[j], "cache_k_%d", j);
        ggml_format_name(c->vt[j], "cache_v_%d", j);
        if (on_device[j] && !device_pool) device_pool = c->kt[j];
    }
    for (int il = 0; il < n_layer; il++) {
        if (pp_layer_kv_source(m, il) != il || plan->pool[il] < 0) continue;   /* recurrent layers keep NULL */
        const int j = plan->pool[il];
        struct ggml_context *where = on_device[j] ? c->device_meta : c->meta;
        c->k[il] = layer_rows(where, c->kt[j], pp_layer_n_embd_kv(m, il), plan->offset[il]);
        c->v[il] = layer_rows(where, c->vt[j], pp_layer_n_embd_kv(m, il), plan->offset[il]);
    }
    /* a layer reading an earlier layer's KV reads its rows */
    for (int il = 0; il < n_layer; il++) {
        c->k[il] = c->k[pp_layer_kv_source(m, il)];
        c->v[il] = c->v[pp_layer_kv_source(m, il)];
    }
    /* A device binds one pool per op: one above its limit (a software Vulkan
     * device takes 128 MiB) would abort inside GGML's scheduler, so it is refused here. */
    if (device_pool && !ggml_backend_dev_supports_op(device, device_pool))
        return pp_fail(PP_ERR_INVALID, "device %s cannot hold a KV pool of %.1f MiB (one layer's K for %lld "
                       "tokens) in one tensor: use a smaller KV budget or fewer GPU layers",
                       ggml_backend_dev_name(device), ggml_nbytes(device_pool) / 1048576.0, (long long)c->num_slots);
    if (n_device_pools > 0) {
        c->device_buffer = ggml_backend_alloc_ctx_tensors_from_buft(c->device_meta,
                                                                    ggml_backend_dev_buffer_type(device));
        if (!c->device_buffer)
            return pp_fail(PP_ERR_NO_MEMORY, "device %s: cannot allocate KV pools of %.1f MiB (%lld tokens)",
                           ggml_backend_dev_name(device), 2.0 * n_device_pools * ggml_nbytes(device_pool) / 1048576.0,
                           (long long)c->num_slots);
        ggml_backend_buffer_clear(c->device_buffer, 0);
    }
    if (n_device_pools < plan->n_pools) {
        c->buffer = ggml_backend_alloc_ctx_tensors_from_buft(c->meta, ggml_backend_cpu_buffer_type());
        if (!c->buffer)
            return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate KV pools of %lld tokens x %lld bytes",
                           (long long)c->num_slots, (long long)pp_kv_cache_bytes_per_slot(c));
        /* Zeroed pools keep never-written slots finite if a bug ever reads them. */
        ggml_backend_buffer_clear(c->buffer, 0);
    }
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
    const int n_layer = m->hp.n_layer;
    for (int il = 0; il < n_layer; il++) {
        const int64_t head_dim = pp_layer_head_dim(m, il);
        if (head_dim % ggml_blck_size(type) != 0)
            return pp_fail(PP_ERR_INVALID, "KV cache type %s quantizes groups of %lld values; head size %lld "
                           "is not a whole number of groups", ggml_type_name(type),
                           (long long)ggml_blck_size(type), (long long)head_dim);
    }
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
    pool_plan plan = {.pool = malloc((size_t)n_layer * sizeof(int32_t)),
                      .offset = malloc((size_t)n_layer * sizeof(int64_t)),
                      .width = malloc((size_t)n_layer * sizeof(int64_t))};
    /* the pools, then a view per layer and K/V at most */
    struct ggml_init_params params = {
        .mem_size = (size_t)(4 * n_layer + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    c->meta = ggml_init(params);
    ggml_backend_dev_t device = pp_model_device(m);
    if (device) c->device_meta = ggml_init(params);
    int st = PP_OK;
    if (!c->k || !c->v || !c->kt || !c->vt || !c->layer_group || !plan.pool || !plan.offset || !plan.width ||
        !c->meta || (device && !c->device_meta))
        st = pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the KV cache tables");
    if (st == PP_OK) st = plan_pools(m, n_groups, layer_group, &plan);
    if (st == PP_OK) {
        for (int il = 0; il < n_layer; il++) c->layer_group[il] = attends(m, il) ? layer_group[il] : 0;
        st = make_pools(c, &plan, device);
    }
    free(plan.pool);
    free(plan.offset);
    free(plan.width);
    if (st != PP_OK) {
        pp_kv_cache_destroy(c);
        return st;
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
    int64_t bytes = 0;   /* the attention layers that keep K/V of their own: a shared-KV layer's are its source's */
    for (int il = 0; il < c->model->hp.n_layer; il++)
        if (pp_layer_kv_source(c->model, il) == il && attends(c->model, il)) bytes += 2 * (int64_t)ggml_row_size(c->type, pp_layer_n_embd_kv(c->model, il));
    return bytes;
}

int64_t pp_kv_cache_bytes_per_slot(const pp_kv_cache *c) {
    if (!c) return 0;
    int64_t bytes = 0;
    for (int j = 0; j < c->n_pools; j++) bytes += 2 * (int64_t)c->kt[j]->nb[1];
    return bytes;
}

/* Bytes of one block of pool j (each of its K and V). */
static size_t block_bytes(const pp_kv_cache *c, int j) { return c->kt[j]->nb[1] * (size_t)c->block_size; }

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
    size_t largest = 0;
    for (int j = 0; j < c->n_pools; j++) largest = block_bytes(c, j) > largest ? block_bytes(c, j) : largest;
    void *staging = NULL;
    if (c->device_buffer && n > 0 && !(staging = malloc(largest)))
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a block's staging buffer");
    for (int j = 0; j < c->n_pools; j++) {
        const size_t bytes = block_bytes(c, j);
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
    for (int j = 0; j < c->n_pools; j++) {
        const size_t bytes = block_bytes(c, j), offset = block_id * bytes;
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
