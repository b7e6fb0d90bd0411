/* The attention operators outside a model, for tests and benchmarks. */
#include "pyllama_paged_testing.h"
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct pp_attention_harness {
    enum ggml_type        type;
    int32_t               num_slots, n_head, n_head_kv, head_dim, n_threads;
    struct ggml_context  *meta;
    ggml_backend_buffer_t buffer;
    struct ggml_tensor   *k, *v;
    struct ggml_tensor   *sinks;       /* [n_head] f32 */
    int32_t               use_sinks;
    ggml_backend_t        backend;
    ggml_gallocr_t        galloc;
    void                 *graph_buf;
    size_t                graph_size;
    pp_attention_scratch  scratch;
};

int32_t pp_attention_harness_create(int32_t kv_type, int32_t num_slots, int32_t n_head,
                                    int32_t n_head_kv, int32_t head_dim, int32_t n_threads,
                                    pp_attention_harness **out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_attention_harness_create: out is NULL");
    *out = NULL;
    enum ggml_type type = (enum ggml_type)kv_type;
    if (type != GGML_TYPE_F16 && type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0)
        return pp_fail(PP_ERR_INVALID, "KV type %d unsupported", kv_type);
    if (num_slots < 1 || n_head < 1 || n_head_kv < 1 || n_head % n_head_kv || head_dim < 1 ||
        head_dim > 512 || n_head / n_head_kv > 32 || head_dim % ggml_blck_size(type) || n_threads < 1)
        return pp_fail(PP_ERR_INVALID, "invalid attention shape (slots %d, heads %d/%d, head_dim %d)",
                       num_slots, n_head, n_head_kv, head_dim);
    pp_attention_harness *h = calloc(1, sizeof *h);
    if (!h) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the harness");
    *h = (pp_attention_harness){.type = type, .num_slots = num_slots, .n_head = n_head, .n_head_kv = n_head_kv,
                                .head_dim = head_dim};
    struct ggml_init_params params = {.mem_size = 4 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    h->meta = ggml_init(params);
    h->graph_size = ggml_tensor_overhead() * 64 + ggml_graph_overhead_custom(64, false);
    h->graph_buf = malloc(h->graph_size);
    h->backend = ggml_backend_cpu_init();
    h->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (h->meta) {
        h->k = ggml_new_tensor_2d(h->meta, type, (int64_t)head_dim * n_head_kv, num_slots);
        h->v = ggml_new_tensor_2d(h->meta, type, (int64_t)head_dim * n_head_kv, num_slots);
        h->sinks = ggml_new_tensor_1d(h->meta, GGML_TYPE_F32, n_head);
        h->buffer = ggml_backend_alloc_ctx_tensors_from_buft(h->meta, ggml_backend_cpu_buffer_type());
    }
    if (!h->meta || !h->buffer || !h->graph_buf || !h->backend || !h->galloc) {
        pp_attention_harness_destroy(h);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a KV pool of %d slots", num_slots);
    }
    if (pp_attention_scratch_init(&h->scratch, head_dim, n_threads) != PP_OK) {
        pp_attention_harness_destroy(h);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate attention tiles for %d threads", n_threads);
    }
    ggml_backend_buffer_clear(h->buffer, 0);
    ggml_backend_cpu_set_n_threads(h->backend, n_threads);
    h->n_threads = n_threads;
    *out = h;
    return PP_OK;
}

void pp_attention_harness_destroy(pp_attention_harness *h) {
    if (!h) return;
    pp_compute_release(h->galloc, h->backend, NULL, 0);   /* the harness makes no thread pool */
    if (h->buffer) ggml_backend_buffer_free(h->buffer);
    if (h->meta) ggml_free(h->meta);
    free(h->graph_buf);
    pp_attention_scratch_release(&h->scratch);
    free(h);
}

/* The arguments of a write or read of n K/V rows at slots (what names the call). */
static int32_t check_rows(const pp_attention_harness *h, const int32_t *slots, int32_t n, const void *k,
                          const void *v, const char *what) {
    if (!h || !slots || !k || !v) return pp_fail(PP_ERR_INVALID, "harness %s: NULL argument", what);
    for (int32_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= h->num_slots)
            return pp_fail(PP_ERR_INVALID, "slot %d outside the pool of %d", slots[i], h->num_slots);
    return PP_OK;
}

int32_t pp_attention_harness_write(pp_attention_harness *h, const int32_t *slots, int32_t n,
                                   const float *k, const float *v) {
    const int32_t st = check_rows(h, slots, n, k, v, "write");
    if (st) return st;
    const int64_t row = (int64_t)h->head_dim * h->n_head_kv;
    const ggml_from_float_t convert = ggml_get_type_traits_cpu(h->type)->from_float;
    for (int32_t i = 0; i < n; i++) {
        convert(k + i * row, (char *)h->k->data + slots[i] * h->k->nb[1], row);
        convert(v + i * row, (char *)h->v->data + slots[i] * h->v->nb[1], row);
    }
    return PP_OK;
}

int32_t pp_attention_harness_read(const pp_attention_harness *h, const int32_t *slots, int32_t n,
                                  float *k, float *v) {
    const int32_t st = check_rows(h, slots, n, k, v, "read");
    if (st) return st;
    const int64_t row = (int64_t)h->head_dim * h->n_head_kv;
    const ggml_to_float_t convert = ggml_get_type_traits(h->type)->to_float;
    for (int32_t i = 0; i < n; i++) {
        convert((const char *)h->k->data + slots[i] * h->k->nb[1], k + i * row, row);
        convert((const char *)h->v->data + slots[i] * h->v->nb[1], v + i * row, row);
    }
    return PP_OK;
}

/* Allocate and run a graph whose only input is q and output is "out". */
static int run_graph(pp_attention_harness *h, struct ggml_context *ctx, struct ggml_tensor *q,
                     struct ggml_tensor *mask, const ggml_fp16_t *mask_data, struct ggml_tensor *out,
                     const float *q_data, float *out_data) {
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, 64, false);
    ggml_set_output(out);
    ggml_build_forward_expand(gf, out);
    if (!ggml_gallocr_alloc_graph(h->galloc, gf)) return pp_fail(PP_ERR_NO_MEMORY, "harness: no compute buffer");
    memcpy(q->data, q_data, ggml_nbytes(q));
    if (mask) memcpy(mask->data, mask_data, ggml_nbytes(mask));
    if (ggml_backend_graph_compute(h->backend, gf) != GGML_STATUS_SUCCESS)
        return pp_fail(PP_ERR_COMPUTE, "harness: graph compute failed");
    memcpy(out_data, out->data, ggml_nbytes(out));
    return PP_OK;
}

int32_t pp_attention_harness_set_sinks(pp_attention_harness *h, const float *sinks) {
    if (!h) return pp_fail(PP_ERR_INVALID, "pp_attention_harness_set_sinks: harness is NULL");
    h->use_sinks = sinks != NULL;
    if (sinks) memcpy(h->sinks->data, sinks, sizeof(float) * (size_t)h->n_head);
    return PP_OK;
}

int32_t pp_attention_harness_paged(pp_attention_harness *h, const pp_batch *b, int32_t block_size,
                                   int32_t window, float scale, const float *q, float *out) {
    if (!h || !b || !q || !out || block_size < 1 || b->n_tokens < 1)
        return pp_fail(PP_ERR_INVALID, "harness paged: invalid argument (or an empty batch)");
    for (int i = 0; i < b->n_tokens; i++) {
        const int order = pp_check_token_order(b, i);
        if (order != PP_OK) return order;
        const int s = b->seq_index[i], pos = b->positions[i];
        if (pos < 0 || pos / block_size >= b->max_blocks_per_seq)
            return pp_fail(PP_ERR_INVALID, "harness paged: token %d out of range", i);
        for (int blk = 0; blk <= pos / block_size; blk++) {
            int32_t id = b->block_tables[(size_t)s * b->max_blocks_per_seq + blk];
            if (id < 0 || (int64_t)(id + 1) * block_size > h->num_slots)
                return pp_fail(PP_ERR_INVALID, "harness paged: block %d outside the pool", id);
        }
    }
    pp_attention_params ap = {.batch = b, .scratch = &h->scratch, .block_size = block_size, .window = window, .scale = scale,
                              .n_head = h->n_head, .n_head_kv = h->n_head_kv, .head_dim = h->head_dim,
                              .sinks = h->use_sinks ? h->sinks->data : NULL};
    struct ggml_init_params params = {.mem_size = h->graph_size, .mem_buffer = h->graph_buf, .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *qt = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, h->head_dim, h->n_head, b->n_tokens);
    ggml_set_input(qt);
    struct ggml_tensor *o = pp_paged_attention(ctx, qt, h->k, h->v, &ap, h->n_threads);
    int st = run_graph(h, ctx, qt, NULL, NULL, o, q, out);
    ggml_free(ctx);
    return st;
}

int32_t pp_attention_harness_contiguous(pp_attention_harness *h, int32_t first_slot, int32_t n_kv,
                                        int32_t n_q, const int32_t *positions, int32_t window,
                                        float scale, const float *q, float *out) {
    if (!h || !positions || !q || !out || n_q < 1 || n_kv < 1 || first_slot < 0 ||
        (int64_t)first_slot + n_kv > h->num_slots)
        return pp_fail(PP_ERR_INVALID, "harness contiguous: invalid argument");
    ggml_fp16_t *mask_data = malloc(sizeof(ggml_fp16_t) * (size_t)n_kv * n_q);
    if (!mask_data) return pp_fail(PP_ERR_NO_MEMORY, "harness: no memory for the mask");
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg = ggml_fp32_to_fp16(-INFINITY);
    for (int i = 0; i < n_q; i++)
        for (int k = 0; k < n_kv; k++)
            mask_data[(size_t)i * n_kv + k] =
                k <= positions[i] && (window <= 0 || positions[i] - k < window) ? zero : neg;
    struct ggml_init_params params = {.mem_size = h->graph_size, .mem_buffer = h->graph_buf, .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *qt = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, h->head_dim, h->n_head, n_q);
    ggml_set_input(qt);
    struct ggml_tensor *mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);
    ggml_set_input(mask);
    const size_t head_bytes = ggml_row_size(h->type, h->head_dim);
    const size_t offset = (size_t)first_slot * h->k->nb[1];
    struct ggml_tensor *ks = ggml_view_3d(ctx, h->k, h->head_dim, n_kv, h->n_head_kv, h->k->nb[1], head_bytes, offset);
    struct ggml_tensor *vs = ggml_view_3d(ctx, h->v, h->head_dim, n_kv, h->n_head_kv, h->v->nb[1], head_bytes, offset);
    struct ggml_tensor *o = ggml_flash_attn_ext(ctx, ggml_permute(ctx, qt, 0, 2, 1, 3), ks, vs, mask, scale, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
    if (h->use_sinks) ggml_flash_attn_ext_add_sinks(o, h->sinks);
    int st = run_graph(h, ctx, qt, mask, mask_data, o, q, out);
    ggml_free(ctx);
    free(mask_data);
    return st;
}
