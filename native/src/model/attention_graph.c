/* GGML's flash attention as graph nodes, and the inputs it reads: over a
 * sequence's contiguous slab (the paged=False baseline), or the portable
 * paged path, each sequence's pages gathered by slot with ggml_get_rows, so
 * paging works on any backend GGML has (pools on a device take this path). */
#include "common/engine_internal.h"

#include <math.h>
#include <stdio.h>

/* The keys a run of one sequence's queries (positions p0..) reads in the
 * gathered path: from the first key of p0's window. */
int pp_gather_first_key(int p0, int window) {
    return window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
}

/* Rows [head_dim, n_kv, n_head_kv] of one sequence's keys (or values): a view
 * of its slab, or its pages' rows gathered by slot ("kv_idx.<t0>.<group>.<windowed>",
 * filled per step, shared by the group's layers). */
static struct ggml_tensor *sequence_rows(struct ggml_context *ctx, const pp_kv_cache *cache,
                                         const pp_batch *batch, struct ggml_tensor *pool,
                                         const pp_attention_params *ap, int t0, int n_kv) {
    if (!cache->paged) {
        const int s = batch->seq_index[t0];
        const int64_t slab = batch->block_tables[(size_t)s * batch->max_blocks_per_seq];
        return ggml_view_3d(ctx, pool, ap->head_dim, n_kv, ap->n_head_kv, pool->nb[1],
                            ggml_row_size(cache->type, ap->head_dim),
                            (size_t)slab * cache->block_size * pool->nb[1]);
    }
    char name[48];
    snprintf(name, sizeof name, "kv_idx.%d.%d.%d", t0, ap->group, ap->window > 0);
    struct ggml_tensor *idx = ggml_get_tensor(ctx, name);
    if (!idx) idx = pp_graph_input(ctx, GGML_TYPE_I32, n_kv, name);
    struct ggml_tensor *rows = ggml_get_rows(ctx, pool, idx);   /* [n_embd_kv, n_kv] f32 */
    return ggml_view_3d(ctx, rows, ap->head_dim, n_kv, ap->n_head_kv, rows->nb[1],
                        ggml_row_size(rows->type, ap->head_dim), 0);
}

/* GGML flash attention of each sequence's queries over its keys: its slab
 * (paged=False) or its gathered pages (the portable paged path). */
struct ggml_tensor *pp_flash_attention(struct ggml_context *ctx, const pp_kv_cache *cache,
                                           const pp_batch *batch, struct ggml_tensor *q,
                                           struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                           const pp_attention_params *ap) {
    struct ggml_tensor *out = NULL;
    for (int t0 = 0; t0 < batch->n_tokens;) {
        const int s = batch->seq_index[t0];
        int t1 = t0;
        while (t1 < batch->n_tokens && batch->seq_index[t1] == s) t1++;
        const int n_q = t1 - t0;
        /* A slab is read from its start; gathered pages from the first query's window. */
        const int k_lo = cache->paged ? pp_gather_first_key(batch->positions[t0], ap->window) : 0;
        const int n_kv = batch->positions[t1 - 1] + 1 - k_lo;
        struct ggml_tensor *qs = ggml_view_3d(ctx, q, ap->head_dim, ap->n_head, n_q, q->nb[1],
                                              q->nb[2], (size_t)t0 * q->nb[2]);
        qs = ggml_permute(ctx, qs, 0, 2, 1, 3);  /* [head_dim, n_q, n_head] */
        struct ggml_tensor *ks = sequence_rows(ctx, cache, batch, k_pool, ap, t0, n_kv);
        struct ggml_tensor *vs = sequence_rows(ctx, cache, batch, v_pool, ap, t0, n_kv);
        /* Layers share masks: one per sequence run and window kind. */
        char name[32];
        snprintf(name, sizeof name, "mask.%d.%d", t0, ap->window > 0);
        struct ggml_tensor *mask = ggml_get_tensor(ctx, name);
        if (!mask) {
            mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);
            ggml_set_name(mask, name);
            ggml_set_input(mask);
        }
        struct ggml_tensor *o = ggml_flash_attn_ext(ctx, qs, ks, vs, mask, ap->scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
        out = out ? ggml_concat(ctx, out, o, 2) : o;  /* [head_dim, n_head, tokens] */
        t0 = t1;
    }
    return out;
}

/* Fill the flash-attention path's masks, "mask.<first token>.<windowed>" per
 * sequence run (windowed layers of one model share a single window size),
 * and, paged, the run's key slots "kv_idx.<first token>.<group>.<windowed>":
 * keys from the first query's window (pp_gather_first_key) to the last query. */
void pp_fill_flash_inputs(struct ggml_cgraph *gf, const pp_batch *b, int swa_window, const pp_kv_cache *cache) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg = ggml_fp32_to_fp16(-INFINITY);
    for (int t0 = 0; t0 < b->n_tokens;) {
        int t1 = t0;
        while (t1 < b->n_tokens && b->seq_index[t1] == b->seq_index[t0]) t1++;
        for (int windowed = 0; windowed < 2; windowed++) {
            char name[32];
            snprintf(name, sizeof name, "mask.%d.%d", t0, windowed);
            struct ggml_tensor *mask = ggml_graph_get_tensor(gf, name);
            if (!mask) continue;
            const int window = windowed ? swa_window : 0;
            const int k_lo = cache->paged ? pp_gather_first_key(b->positions[t0], window) : 0;
            ggml_fp16_t *data = mask->data;
            const int64_t n_kv = mask->ne[0];
            for (int i = t0; i < t1; i++) {
                const int pos = b->positions[i];
                for (int64_t j = 0; j < n_kv; j++) {
                    const int64_t k = k_lo + j;
                    const int visible = k <= pos && (window <= 0 || pos - k < window);
                    data[(i - t0) * n_kv + j] = visible ? zero : neg;
                }
            }
            const int bs = cache->block_size;
            const size_t table_stride = (size_t)b->n_seqs * b->max_blocks_per_seq;
            for (int32_t g = 0; cache->paged && g < cache->n_groups; g++) {
                char idx_name[48];
                snprintf(idx_name, sizeof idx_name, "kv_idx.%d.%d.%d", t0, g, windowed);
                struct ggml_tensor *idx = ggml_graph_get_tensor(gf, idx_name);
                if (!idx) continue;
                const int32_t *table = b->block_tables + g * table_stride +
                                       (size_t)b->seq_index[t0] * b->max_blocks_per_seq;
                int32_t *slots = idx->data;
                for (int64_t j = 0; j < idx->ne[0]; j++) {
                    const int64_t k = k_lo + j;
                    slots[j] = table[k / bs] * bs + (int32_t)(k % bs);
                }
            }
        }
        t0 = t1;
    }
}

