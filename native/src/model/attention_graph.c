/* GGML's flash attention as graph nodes, and the inputs it reads.
 *
 * Paged caches (pools on a device, or the gather path on the CPU): the
 * batch's sequence runs are grouped by their number of queries, and each
 * group is ONE flash-attention call per layer, the runs stacked along the
 * call's 4th dimension. Each run's keys are gathered by slot from the pool
 * (one ggml_get_rows per group, K and V), padded to a bucketed length
 * (bucket()) whose extra keys the mask hides. A decode step is
 * then one group: the same nodes and inputs at 1 or 64 sequences, and the
 * same shapes from step to step until a bucket fills, so the context can
 * reuse the graph (context.c) and a device can replay it.
 *
 * Slabs (paged=False, the baseline): one call per sequence over a view of
 * its slab. */
#include "common/engine_internal.h"

#include <math.h>
#include <stdio.h>

/* The keys a run of one sequence's queries (positions p0..) reads in the
 * gathered path: from the first key of p0's window. */
int pp_gather_first_key(int p0, int window) {
    return window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
}

/* Keys a run gathers: from its first query's window to its last query. */
static int run_keys(const pp_batch *b, const pp_flash_plan *p, int r, int window) {
    const int t0 = p->run_t0[r];
    return b->positions[t0 + p->run_nq[r] - 1] + 1 - pp_gather_first_key(b->positions[t0], window);
}

/* Keys gathered per run: n rounded up to a step of an eighth of the next power of two (at
 * least PP_FLASH_KV_BUCKET), so padding stays under 1/8 of the keys while a growing sequence
 * changes the graph's shape only every 64, 128, ... steps. */
static int32_t bucket(int32_t n) {
    int32_t p = 1;
    while (p < n) p <<= 1;
    const int32_t step = p / 8 > PP_FLASH_KV_BUCKET ? p / 8 : PP_FLASH_KV_BUCKET;
    return (n + step - 1) / step * step;
}

void pp_flash_plan_make(pp_flash_plan *p, const pp_batch *b, int swa_window) {
    p->n_runs = 0;
    for (int t0 = 0; t0 < b->n_tokens;) {
        int t1 = t0;
        while (t1 < b->n_tokens && b->seq_index[t1] == b->seq_index[t0]) t1++;
        p->run_t0[p->n_runs] = t0;
        p->run_nq[p->n_runs] = t1 - t0;
        p->n_runs++;
        t0 = t1;
    }
    /* Groups in order of first appearance; at most sqrt(2 n_tokens) of them
     * (distinct run lengths sum to at most n_tokens), so the scans are short. */
    p->n_groups = 0;
    int placed = 0;
    p->in_order = 1;
    for (int r = 0; r < p->n_runs; r++) {
        int seen = 0;
        for (int g = 0; g < p->n_groups && !seen; g++) seen = p->group_nq[g] == p->run_nq[r];
        if (seen) continue;
        const int g = p->n_groups++;
        p->group_nq[g] = p->run_nq[r];
        p->group_first[g] = placed;
        p->group_kv[2 * g] = p->group_kv[2 * g + 1] = 0;
        for (int s = r; s < p->n_runs; s++) {
            if (p->run_nq[s] != p->group_nq[g]) continue;
            if (s != placed) p->in_order = 0;
            p->order[placed++] = s;
            for (int w = 0; w < 2; w++) {
                const int keys = run_keys(b, p, s, w ? swa_window : 0);
                if (keys > p->group_kv[2 * g + w]) p->group_kv[2 * g + w] = keys;
            }
        }
        p->group_kv[2 * g] = bucket(p->group_kv[2 * g]);
        p->group_kv[2 * g + 1] = bucket(p->group_kv[2 * g + 1]);
    }
    p->group_first[p->n_groups] = placed;
}

uint64_t pp_flash_plan_shape(const pp_flash_plan *p) {
    /* FNV-1a over what the graph's shapes depend on */
    uint64_t h = 1469598103934665603ull;
#define MIX(v) (h = (h ^ (uint64_t)(uint32_t)(v)) * 1099511628211ull)
    MIX(p->n_groups);
    MIX(p->in_order);
    for (int g = 0; g < p->n_groups; g++) {
        MIX(p->group_nq[g]);
        MIX(p->group_first[g + 1] - p->group_first[g]);
        MIX(p->group_kv[2 * g]);
        MIX(p->group_kv[2 * g + 1]);
    }
#undef MIX
    return h;
}

/* A step input shared by the layers that ask for it by name. */
static struct ggml_tensor *shared_input(struct ggml_context *ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
                                        int64_t ne3, const char *name) {
    struct ggml_tensor *t = ggml_get_tensor(ctx, name);
    if (t) return t;
    t = ggml_new_tensor_4d(ctx, type, ne0, ne1, 1, ne3);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

/* One group's keys (or values) [head_dim, n_kv, n_head_kv, n_runs]: the
 * runs' slots ("kv_idx.<group>.<layer group>.<windowed>") gathered from the pool. */
static struct ggml_tensor *gathered_rows(struct ggml_context *ctx, struct ggml_tensor *pool,
                                         const pp_attention_params *ap, int g, int n_kv, int n_runs) {
    char name[48];
    snprintf(name, sizeof name, "kv_idx.%d.%d.%d", g, ap->group, ap->window > 0);
    struct ggml_tensor *idx = shared_input(ctx, GGML_TYPE_I32, (int64_t)n_kv * n_runs, 1, 1, name);
    struct ggml_tensor *rows = ggml_get_rows(ctx, pool, idx);   /* [n_embd_kv, n_kv * n_runs] f32 */
    return ggml_view_4d(ctx, rows, ap->head_dim, n_kv, ap->n_head_kv, n_runs, rows->nb[1],
                        ggml_row_size(rows->type, ap->head_dim), (size_t)n_kv * rows->nb[1], 0);
}

static struct ggml_tensor *paged_flash_attention(struct ggml_context *ctx, const pp_flash_plan *p,
                                                 struct ggml_tensor *q, struct ggml_tensor *k_pool,
                                                 struct ggml_tensor *v_pool, const pp_attention_params *ap) {
    const int windowed = ap->window > 0;
    const int64_t row = (int64_t)ap->head_dim * ap->n_head;
    struct ggml_tensor *q_rows = ggml_reshape_2d(ctx, q, row, q->ne[2]);
    struct ggml_tensor *out = NULL;
    for (int g = 0; g < p->n_groups; g++) {
        const int n_q = p->group_nq[g], n_runs = p->group_first[g + 1] - p->group_first[g];
        const int n_kv = p->group_kv[2 * g + windowed];
        struct ggml_tensor *qg;
        if (p->in_order) {   /* the group's tokens are one slice of the batch */
            const int t0 = p->run_t0[p->order[p->group_first[g]]];
            qg = ggml_view_4d(ctx, q, ap->head_dim, ap->n_head, n_q, n_runs, q->nb[1], q->nb[2],
                              (size_t)n_q * q->nb[2], (size_t)t0 * q->nb[2]);
        } else {
            char name[32];
            snprintf(name, sizeof name, "q_rows.%d", g);
            struct ggml_tensor *idx = shared_input(ctx, GGML_TYPE_I32, (int64_t)n_q * n_runs, 1, 1, name);
            qg = ggml_reshape_4d(ctx, ggml_get_rows(ctx, q_rows, idx), ap->head_dim, ap->n_head, n_q, n_runs);
        }
        qg = ggml_permute(ctx, qg, 0, 2, 1, 3);   /* [head_dim, n_q, n_head, n_runs] */
        struct ggml_tensor *k = gathered_rows(ctx, k_pool, ap, g, n_kv, n_runs);
        struct ggml_tensor *v = gathered_rows(ctx, v_pool, ap, g, n_kv, n_runs);
        char name[32];
        snprintf(name, sizeof name, "mask.%d.%d", g, windowed);
        struct ggml_tensor *mask = shared_input(ctx, GGML_TYPE_F16, n_kv, n_q, n_runs, name);
        struct ggml_tensor *o = ggml_flash_attn_ext(ctx, qg, k, v, mask, ap->scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
        if (ap->sinks_tensor) ggml_flash_attn_ext_add_sinks(o, ap->sinks_tensor);
        o = ggml_reshape_2d(ctx, o, row, (int64_t)n_q * n_runs);   /* [head_dim x n_head, tokens] */
        out = out ? ggml_concat(ctx, out, o, 1) : o;
    }
    if (!p->in_order) {   /* the groups' rows back into the batch's token order */
        struct ggml_tensor *order = shared_input(ctx, GGML_TYPE_I32, q->ne[2], 1, 1, "flash_order");
        out = ggml_get_rows(ctx, out, order);
    }
    return out;
}

/* GGML flash attention of one sequence's queries over a view of its slab. */
static struct ggml_tensor *slab_flash_attention(struct ggml_context *ctx, const pp_kv_cache *cache,
                                                const pp_batch *batch, struct ggml_tensor *q,
                                                struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                                const pp_attention_params *ap) {
    struct ggml_tensor *out = NULL;
    for (int t0 = 0; t0 < batch->n_tokens;) {
        const int s = batch->seq_index[t0];
        int t1 = t0;
        while (t1 < batch->n_tokens && batch->seq_index[t1] == s) t1++;
        const int n_q = t1 - t0;
        const int n_kv = batch->positions[t1 - 1] + 1;
        struct ggml_tensor *qs = ggml_view_3d(ctx, q, ap->head_dim, ap->n_head, n_q, q->nb[1],
                                              q->nb[2], (size_t)t0 * q->nb[2]);
        qs = ggml_permute(ctx, qs, 0, 2, 1, 3);  /* [head_dim, n_q, n_head] */
        const int64_t slab = batch->block_tables[(size_t)s * batch->max_blocks_per_seq];
        const size_t offset = (size_t)slab * cache->block_size * k_pool->nb[1];
        const size_t head_bytes = ggml_row_size(cache->type, ap->head_dim);
        struct ggml_tensor *ks = ggml_view_3d(ctx, k_pool, ap->head_dim, n_kv, ap->n_head_kv, k_pool->nb[1],
                                              head_bytes, offset);
        struct ggml_tensor *vs = ggml_view_3d(ctx, v_pool, ap->head_dim, n_kv, ap->n_head_kv, v_pool->nb[1],
                                              head_bytes, offset);
        /* Layers share masks: one per sequence run and window kind. */
        char name[32];
        snprintf(name, sizeof name, "slab_mask.%d.%d", t0, ap->window > 0);
        struct ggml_tensor *mask = shared_input(ctx, GGML_TYPE_F16, n_kv, n_q, 1, name);
        struct ggml_tensor *o = ggml_flash_attn_ext(ctx, qs, ks, vs, mask, ap->scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
        if (ap->sinks_tensor) ggml_flash_attn_ext_add_sinks(o, ap->sinks_tensor);
        out = out ? ggml_concat(ctx, out, o, 2) : o;  /* [head_dim, n_head, tokens] */
        t0 = t1;
    }
    return out;
}

struct ggml_tensor *pp_flash_attention(struct ggml_context *ctx, const pp_kv_cache *cache,
                                       const pp_batch *batch, struct ggml_tensor *q,
                                       struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                       const pp_attention_params *ap) {
    if (cache->paged) return paged_flash_attention(ctx, ap->plan, q, k_pool, v_pool, ap);
    return slab_flash_attention(ctx, cache, batch, q, k_pool, v_pool, ap);
}

static void fill_mask_rows(ggml_fp16_t *data, const pp_batch *b, int t0, int n_q, int k_lo, int64_t n_kv,
                           int window) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), neg = ggml_fp32_to_fp16(-INFINITY);
    for (int i = 0; i < n_q; i++) {
        const int pos = b->positions[t0 + i];
        for (int64_t j = 0; j < n_kv; j++) {
            const int64_t k = k_lo + j;
            const int visible = k <= pos && (window <= 0 || pos - k < window);
            data[i * n_kv + j] = visible ? zero : neg;
        }
    }
}

/* The slab path's masks, "slab_mask.<first token>.<windowed>" per sequence run. */
static void fill_slab_inputs(struct ggml_cgraph *gf, const pp_batch *b, int swa_window) {
    for (int t0 = 0; t0 < b->n_tokens;) {
        int t1 = t0;
        while (t1 < b->n_tokens && b->seq_index[t1] == b->seq_index[t0]) t1++;
        for (int windowed = 0; windowed < 2; windowed++) {
            char name[32];
            snprintf(name, sizeof name, "slab_mask.%d.%d", t0, windowed);
            struct ggml_tensor *mask = ggml_graph_get_tensor(gf, name);
            if (mask) fill_mask_rows(mask->data, b, t0, t1 - t0, 0, mask->ne[0], windowed ? swa_window : 0);
        }
        t0 = t1;
    }
}

/* The paged path's inputs per group: masks ("mask.<group>.<windowed>"), the
 * runs' key slots per layer group ("kv_idx.<group>.<layer group>.<windowed>":
 * keys from the first query's window, padding repeating the run's first key,
 * which the mask hides), and, when the groups reorder the batch, the query
 * rows ("q_rows.<group>") and the way back ("flash_order"). */
static void fill_paged_inputs(struct ggml_cgraph *gf, const pp_batch *b, const pp_flash_plan *p, int swa_window,
                              const pp_kv_cache *cache) {
    const int bs = cache->block_size;
    const size_t table_stride = (size_t)b->n_seqs * b->max_blocks_per_seq;
    char name[48];
    int32_t *back = NULL;
    if (!p->in_order) {
        struct ggml_tensor *order = ggml_graph_get_tensor(gf, "flash_order");
        back = order ? order->data : NULL;
    }
    int32_t row = 0;   /* the group's first row in the concatenated output */
    for (int g = 0; g < p->n_groups; g++) {
        const int n_q = p->group_nq[g];
        int32_t *q_rows = NULL;
        if (!p->in_order) {
            snprintf(name, sizeof name, "q_rows.%d", g);
            struct ggml_tensor *t = ggml_graph_get_tensor(gf, name);
            q_rows = t ? t->data : NULL;
        }
        for (int i = p->group_first[g]; i < p->group_first[g + 1]; i++) {
            const int r = p->order[i], t0 = p->run_t0[r], j = i - p->group_first[g];
            for (int q = 0; q < n_q; q++) {
                if (q_rows) q_rows[j * n_q + q] = t0 + q;
                if (back) back[t0 + q] = row + j * n_q + q;
            }
        }
        row += n_q * (p->group_first[g + 1] - p->group_first[g]);
        for (int windowed = 0; windowed < 2; windowed++) {
            const int window = windowed ? swa_window : 0;
            const int n_kv = p->group_kv[2 * g + windowed];
            snprintf(name, sizeof name, "mask.%d.%d", g, windowed);
            struct ggml_tensor *mask = ggml_graph_get_tensor(gf, name);
            if (!mask) continue;   /* no layer of this window kind */
            for (int i = p->group_first[g]; i < p->group_first[g + 1]; i++) {
                const int r = p->order[i], t0 = p->run_t0[r], j = i - p->group_first[g];
                const int k_lo = pp_gather_first_key(b->positions[t0], window);
                fill_mask_rows((ggml_fp16_t *)mask->data + (size_t)j * n_q * n_kv, b, t0, n_q, k_lo, n_kv, window);
            }
            for (int32_t lg = 0; lg < cache->n_groups; lg++) {
                snprintf(name, sizeof name, "kv_idx.%d.%d.%d", g, lg, windowed);
                struct ggml_tensor *idx = ggml_graph_get_tensor(gf, name);
                if (!idx) continue;
                int32_t *slots = idx->data;
                for (int i = p->group_first[g]; i < p->group_first[g + 1]; i++) {
                    const int r = p->order[i], t0 = p->run_t0[r], j = i - p->group_first[g];
                    const int k_lo = pp_gather_first_key(b->positions[t0], window);
                    const int keys = run_keys(b, p, r, window);
                    const int32_t *table = b->block_tables + lg * table_stride +
                                           (size_t)b->seq_index[t0] * b->max_blocks_per_seq;
                    int32_t *run_slots = slots + (size_t)j * n_kv;
                    for (int k = 0; k < keys; k++)
                        run_slots[k] = table[(k_lo + k) / bs] * bs + (k_lo + k) % bs;
                    for (int k = keys; k < n_kv; k++) run_slots[k] = run_slots[0];
                }
            }
        }
    }
}

void pp_fill_flash_inputs(struct ggml_cgraph *gf, const pp_batch *b, const pp_flash_plan *p, int swa_window,
                          const pp_kv_cache *cache) {
    if (cache->paged) fill_paged_inputs(gf, b, p, swa_window, cache);
    else fill_slab_inputs(gf, b, swa_window);
}
