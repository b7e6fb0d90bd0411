/* Paged attention on the CPU, run by GGML's thread pool as a custom op.
 *
 * Work is split into (query tile, KV head) items. A tile is up to a few
 * consecutive tokens of one sequence; with the query heads of the KV head's
 * GQA group it forms at most PP_ATTN_MAX_ROWS query rows. The kernel walks
 * the tile's key range through the sequence's block table in chunks that
 * never cross a page, converts each chunk's K and V rows to f32 once for all
 * rows of the tile (prefill reuses every key across the tile's tokens,
 * decode across the group's heads), scores them, masks per row (causal and
 * sliding window), and folds the chunk into an online softmax (running max,
 * running sum, rescaled accumulator): no score matrix is ever materialized
 * beyond one chunk. The row arithmetic (conversion, dots, exp, P.V) is in
 * attention_math.c.
 *
 * One order for every batch (docs/batch-invariance.md): a row's keys are cut
 * at absolute positions, into chunks at multiples of PP_ATTN_KEY_CHUNK (and
 * page ends) and slices at multiples of PP_ATTN_SLICE_KEYS; each slice is
 * an online softmax of its own, and the slices are merged in key order by
 * one function (merge_state). Whatever tile a row shares, whichever thread
 * runs it and whether a decode splits its keys across threads, the row's
 * floats take the same operations in the same order. */
#include "kernels/attention_math.h"
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int key_begin(const pp_attention_params *ap, int pos) {
    return ap->window > 0 && pos - ap->window + 1 > 0 ? pos - ap->window + 1 : 0;
}

/* Working memory of one tile, sized by the caller for rows x head_dim. */
typedef struct tile_state {
    float *q;        /* [rows][head_dim] queries, pre-scaled */
    float *acc;      /* [rows][head_dim] the current slice's unnormalized outputs */
    float *tot;      /* [rows][head_dim] the slices merged so far, unnormalized */
    float *k, *v;    /* [KEY_CHUNK][head_dim] the chunk's rows in f32 */
    float *p;        /* [rows][KEY_CHUNK] scores, then probabilities */
    char  *q8;       /* [rows][q8_row] the queries as q8_0 (q8_0 caches only) */
    const pp_attention_math *math;
    float run_max[PP_ATTN_MAX_ROWS];
    float run_sum[PP_ATTN_MAX_ROWS];
    float correction[PP_ATTN_MAX_ROWS];   /* this chunk's rescale of each row's acc */
    float tot_max[PP_ATTN_MAX_ROWS];      /* the merged slices' max and sum */
    float tot_sum[PP_ATTN_MAX_ROWS];
} tile_state;

/* Fold one slice's softmax state (acc_s, max_s, sum_s) into a merged one, in
 * place. The only place slices meet: the tile walk and the split-K merge
 * both call it (noinline: one compiled copy, so one rounding). A slice with
 * nothing visible is skipped; a merged state that is still empty (max
 * -inf, sum 0, acc 0) takes the slice exactly. */
static __attribute__((noinline)) void merge_state(float *restrict acc, float *max, float *sum,
                                                  const float *restrict acc_s, float max_s, float sum_s, int hd) {
    if (sum_s == 0.0f) return;
    const float m = max_s > *max ? max_s : *max;
    const float a = expf(*max - m), b = expf(max_s - m);
    for (int d = 0; d < hd; d++) acc[d] = acc[d] * a + acc_s[d] * b;
    *sum = *sum * a + sum_s * b;
    *max = m;
}

/* The merged state a row starts from: the layer's sink for its query head
 * (one more key of value 0: max = sink, sum = 1), or nothing. */
static void start_merged(const pp_attention_params *ap, int kvh, int rows, int with_sink, tile_state *st) {
    const int group = ap->n_head / ap->n_head_kv;
    const int sink = with_sink && ap->sinks;
    for (int r = 0; r < rows; r++) {
        st->tot_max[r] = sink ? ap->sinks[kvh * group + r % group] : -INFINITY;
        st->tot_sum[r] = sink ? 1.0f : 0.0f;
    }
    memset(st->tot, 0, sizeof(float) * (size_t)rows * ap->head_dim);
}

/* Close the current slice of every row: merged into tot, and a fresh
 * online softmax for the next. */
static void close_slice(int rows, int hd, tile_state *st) {
    for (int r = 0; r < rows; r++) {
        merge_state(st->tot + (size_t)r * hd, &st->tot_max[r], &st->tot_sum[r], st->acc + (size_t)r * hd,
                    st->run_max[r], st->run_sum[r], hd);
        st->run_max[r] = -INFINITY;
        st->run_sum[r] = 0.0f;
    }
    memset(st->acc, 0, sizeof(float) * (size_t)rows * hd);
}

/* Keys [*lo, *hi) of the chunk starting at key k0 (n keys) that a query at
 * pos sees: causal, and within the window if the layer has one. */
static void visible_keys(const pp_attention_params *ap, int pos, int k0, int n, int *lo, int *hi) {
    *lo = key_begin(ap, pos) - k0;
    *hi = pos + 1 - k0;
    if (*lo < 0) *lo = 0;
    if (*hi > n) *hi = n;
}

/* Fold keys [k_lo, k_hi) of the sequence of tokens [t0, t1) into st for KV
 * head kvh; row r is token t0 + r / group, query head kvh * group + r % group.
 * Each row still sees only its own causal (and window) range. The result is
 * st->tot, tot_max, tot_sum: the range's slices merged in order onto the
 * sink (with_sink and the layer has sinks) or onto nothing. */
static void attend_tile(const pp_attention_params *ap, const struct ggml_tensor *q,
                        const struct ggml_tensor *kc, const struct ggml_tensor *vc, int t0, int t1,
                        int kvh, int k_lo, int k_hi, int with_sink, tile_state *st) {
    const pp_batch *batch = ap->batch;
    const int hd = ap->head_dim;
    const int group = ap->n_head / ap->n_head_kv;
    const int rows = (t1 - t0) * group;
    const int bs = ap->block_size;
    const size_t kv_head_bytes = ggml_row_size(kc->type, hd);
    /* The layer's group's tables (group-major, see pp_batch). */
    const int32_t *table = batch->block_tables +
                           ((size_t)ap->group * batch->n_seqs + batch->seq_index[t0]) * batch->max_blocks_per_seq;

    /* q8_0 keys are dotted in int8 against queries quantized to q8_0 (their vec_dot_type). */
    const struct ggml_type_traits_cpu *k_traits = kc->type == GGML_TYPE_Q8_0 ? ggml_get_type_traits_cpu(kc->type) : NULL;
    const ggml_from_float_t quantize_q = k_traits ? ggml_get_type_traits_cpu(k_traits->vec_dot_type)->from_float : NULL;
    const size_t q8_row = ggml_row_size(GGML_TYPE_Q8_0, hd);
    for (int r = 0; r < rows; r++) {
        const float *qrow = (const float *)((const char *)q->data + (t0 + r / group) * q->nb[2] +
                                            (size_t)(kvh * group + r % group) * q->nb[1]);
        for (int d = 0; d < hd; d++) st->q[(size_t)r * hd + d] = qrow[d] * ap->scale;
        if (quantize_q) quantize_q(st->q + (size_t)r * hd, st->q8 + (size_t)r * q8_row, hd);
        st->run_max[r] = -INFINITY;
        st->run_sum[r] = 0.0f;
    }
    memset(st->acc, 0, sizeof(float) * (size_t)rows * hd);
    start_merged(ap, kvh, rows, with_sink, st);

    for (int k0 = k_lo; k0 < k_hi;) {
        if (k0 > k_lo && k0 % PP_ATTN_SLICE_KEYS == 0) close_slice(rows, hd, st);
        const int page_end = (k0 / bs + 1) * bs;
        const int chunk_end = (k0 / PP_ATTN_KEY_CHUNK + 1) * PP_ATTN_KEY_CHUNK;
        int k1 = page_end < k_hi ? page_end : k_hi;
        if (k1 > chunk_end) k1 = chunk_end;
        const int n = k1 - k0;
        const int64_t slot0 = (int64_t)table[k0 / bs] * bs + k0 % bs;
        const char *krows = (const char *)kc->data + slot0 * kc->nb[1] + kvh * kv_head_bytes;
        const char *vrows = (const char *)vc->data + slot0 * vc->nb[1] + kvh * kv_head_bytes;
        for (int j = 0; j < n; j++) {
            if (!k_traits) st->math->row_to_f32(kc, krows + j * kc->nb[1], st->k + (size_t)j * hd, hd);
            st->math->row_to_f32(vc, vrows + j * vc->nb[1], st->v + (size_t)j * hd, hd);
        }
        /* q8_0 keys: integer dots straight from the cache against the
         * quantized queries (GGML's vec_dot), no f32 copy of K. */
        for (int r = 0; k_traits && r < rows; r++) {
            int lo, hi;
            visible_keys(ap, batch->positions[t0 + r / group], k0, n, &lo, &hi);
            for (int j = lo; j < hi; j++)
                k_traits->vec_dot(hd, st->p + (size_t)r * PP_ATTN_KEY_CHUNK + j, 0, krows + j * kc->nb[1], 0,
                                  st->q8 + (size_t)r * q8_row, 0, 1);
        }
        /* f32 keys: scores two rows at a time over the union of their visible keys. */
        for (int r = 0; !k_traits && r < rows; r += 2) {
            const int r1 = r + 1 < rows ? r + 1 : r;
            int lo0, hi0, lo1, hi1;
            visible_keys(ap, batch->positions[t0 + r / group], k0, n, &lo0, &hi0);
            visible_keys(ap, batch->positions[t0 + r1 / group], k0, n, &lo1, &hi1);
            const int lo = lo0 < lo1 ? lo0 : lo1, hi = hi0 > hi1 ? hi0 : hi1;
            if (lo >= hi) continue;
            float *p0 = st->p + (size_t)r * PP_ATTN_KEY_CHUNK + lo;
            const float *kl = st->k + (size_t)lo * hd;
            if (r1 != r)
                st->math->dot_rows2(st->q + (size_t)r * hd, st->q + (size_t)r1 * hd, kl, hi - lo, hd, p0,
                             st->p + (size_t)r1 * PP_ATTN_KEY_CHUNK + lo);
            else
                st->math->dot_rows(st->q + (size_t)r * hd, kl, hi - lo, hd, p0);
        }
        /* Online softmax per row; masked keys get probability 0. */
        for (int r = 0; r < rows; r++) {
            float *p = st->p + (size_t)r * PP_ATTN_KEY_CHUNK;
            int j_lo, j_hi;
            visible_keys(ap, batch->positions[t0 + r / group], k0, n, &j_lo, &j_hi);
            st->correction[r] = 1.0f;
            if (j_lo >= j_hi) {
                memset(p, 0, sizeof(float) * n);
                continue;
            }
            float m = st->run_max[r];
            for (int j = j_lo; j < j_hi; j++) m = p[j] > m ? p[j] : m;
            const float correction = expf(st->run_max[r] - m);
            const float sum = st->math->exp_shifted(p + j_lo, j_hi - j_lo, m);
            for (int j = 0; j < j_lo; j++) p[j] = 0.0f;
            for (int j = j_hi; j < n; j++) p[j] = 0.0f;
            st->run_sum[r] = st->run_sum[r] * correction + sum;
            st->run_max[r] = m;
            st->correction[r] = correction;
        }
        for (int r = 0; r < rows; r += 2) {
            float *acc = st->acc + (size_t)r * hd;
            const float *p = st->p + (size_t)r * PP_ATTN_KEY_CHUNK;
            if (r + 1 < rows)
                st->math->accumulate_pv2(acc, acc + hd, st->correction[r], st->correction[r + 1], p,
                                  p + PP_ATTN_KEY_CHUNK, st->v, n, hd);
            else
                st->math->accumulate_pv(acc, st->correction[r], p, st->v, n, hd);
        }
        k0 = k1;
    }
    close_slice(rows, hd, st);
}

/* Tokens per tile: as many as fit PP_ATTN_MAX_ROWS rows, but small enough
 * that every thread gets about two items. */
static int tile_tokens(const pp_attention_params *ap, int nth) {
    const int group = ap->n_head / ap->n_head_kv;
    int tq = PP_ATTN_MAX_ROWS / group;
    const int by_threads = ap->batch->n_tokens * ap->n_head_kv / (2 * nth);
    if (tq > by_threads) tq = by_threads;
    return tq > 0 ? tq : 1;
}

/* Floats of one thread's tile memory for rows x hd (see tile_state). */
static size_t tile_floats(int rows, int hd) {
    const size_t q8_floats = (rows * ggml_row_size(GGML_TYPE_Q8_0, hd) + sizeof(float) - 1) / sizeof(float);
    return (size_t)3 * rows * hd + (size_t)2 * PP_ATTN_KEY_CHUNK * hd + (size_t)rows * PP_ATTN_KEY_CHUNK +
           q8_floats;
}

int32_t pp_attention_scratch_init(pp_attention_scratch *s, int32_t head_dim, int32_t n_threads) {
    const size_t per_thread = tile_floats(PP_ATTN_MAX_ROWS, head_dim);
    float *data = malloc(sizeof(float) * per_thread * (size_t)n_threads);
    if (!data) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate attention tiles for %d threads", n_threads);
    free(s->data);
    s->data = data;
    s->floats_per_thread = per_thread;
    s->n_threads = n_threads;
    s->math = pp_attention_math_select();
    return PP_OK;
}

void pp_attention_scratch_release(pp_attention_scratch *s) {
    free(s->data);
    memset(s, 0, sizeof *s);
}

/* Point st's arrays into thread ith's slice of the scratch made at context
 * creation: the kernel never allocates while a step runs. */
static void tile_state_init(tile_state *st, const pp_attention_params *ap, int ith, int rows) {
    const pp_attention_scratch *scratch = ap->scratch;
    const int hd = ap->head_dim;
    /* GGML runs a custom op on at most the backend's threads, which the scratch was sized for. */
    GGML_ASSERT(ith < scratch->n_threads && rows <= PP_ATTN_MAX_ROWS &&
                tile_floats(rows, hd) <= scratch->floats_per_thread);
    float *f = scratch->data + (size_t)ith * scratch->floats_per_thread;
    st->math = scratch->math;
    st->q = f;
    st->acc = st->q + (size_t)rows * hd;
    st->tot = st->acc + (size_t)rows * hd;
    st->k = st->tot + (size_t)rows * hd;
    st->v = st->k + (size_t)PP_ATTN_KEY_CHUNK * hd;
    st->p = st->v + (size_t)PP_ATTN_KEY_CHUNK * hd;
    st->q8 = (char *)(st->p + (size_t)rows * PP_ATTN_KEY_CHUNK);
}

/* out = acc / sum (0 where nothing was visible), for the tile walk and the split-K merge alike. */
static void normalize(float *restrict out, const float *restrict acc, float sum, int hd) {
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int d = 0; d < hd; d++) out[d] = acc[d] * inv;
}

void pp_paged_attention_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const pp_attention_params *ap = userdata;
    const pp_batch *batch = ap->batch;
    const int hd = ap->head_dim;
    const int group = ap->n_head / ap->n_head_kv;
    const int tq = tile_tokens(ap, nth);
    GGML_ASSERT(group <= PP_ATTN_MAX_ROWS);
    tile_state st;
    tile_state_init(&st, ap, ith, tq * group);

    /* Tiles are cut the same way by every thread; item i goes to thread i % nth. */
    int item = 0;
    for (int t0 = 0; t0 < batch->n_tokens;) {
        int t1 = t0 + 1;
        while (t1 < batch->n_tokens && t1 - t0 < tq && batch->seq_index[t1] == batch->seq_index[t0]) t1++;
        for (int kvh = 0; kvh < ap->n_head_kv; kvh++, item++) {
            if (item % nth != ith) continue;
            const int k_lo = key_begin(ap, batch->positions[t0]), k_hi = batch->positions[t1 - 1] + 1;
            attend_tile(ap, dst->src[0], dst->src[1], dst->src[2], t0, t1, kvh, k_lo, k_hi, 1, &st);
            for (int r = 0; r < (t1 - t0) * group; r++) {
                float *out = (float *)((char *)dst->data + (t0 + r / group) * dst->nb[2] +
                                       (size_t)(kvh * group + r % group) * dst->nb[1]);
                normalize(out, st.tot + (size_t)r * hd, st.tot_sum[r], hd);
            }
        }
        t0 = t1;
    }
}

/* Split-K. Work unit (token, KV head, slice) folds one slice of the token's
 * key range (the same absolute slices as the tile walk) into its
 * unnormalized accumulator plus (max, sum), stored after the output in dst
 * as [head_dim + 2] per (item, slice, group head). The thread that finishes
 * last merges them in key order with merge_state, onto the sink as the tile
 * walk does: one op, where a separate merge op cost a barrier per layer
 * (and, on two threads, a decode step's attention ran on one while the
 * other waited), and the same floats as a step that does not split. */
static float *slice_part(float *parts, int item, int split, int g, int n_splits, int group, int hd) {
    return parts + (((size_t)item * n_splits + split) * group + g) * (size_t)(hd + 2);
}

/* Token pos's slice s: keys [*k_begin, *k_end), empty past its last slice. */
static void slice_keys(const pp_attention_params *ap, int pos, int s, int *k_begin, int *k_end) {
    const int lo = key_begin(ap, pos);
    const int s0 = (lo / PP_ATTN_SLICE_KEYS + s) * PP_ATTN_SLICE_KEYS;
    *k_begin = s0 > lo ? s0 : lo;
    *k_end = s0 + PP_ATTN_SLICE_KEYS < pos + 1 ? s0 + PP_ATTN_SLICE_KEYS : pos + 1;
}

static void merge_slices(const pp_attention_params *ap, float *parts, int n_splits, float *out_base,
                         tile_state *st) {
    const int hd = ap->head_dim, n_kv = ap->n_head_kv, group = ap->n_head / ap->n_head_kv;
    const int n_items = ap->batch->n_tokens * n_kv;
    for (int item = 0; item < n_items; item++) {
        const int t = item / n_kv, kvh = item % n_kv;
        start_merged(ap, kvh, group, 1, st);
        for (int g = 0; g < group; g++) {
            for (int s = 0; s < n_splits; s++) {
                const float *p = slice_part(parts, item, s, g, n_splits, group, hd);
                merge_state(st->tot + (size_t)g * hd, &st->tot_max[g], &st->tot_sum[g], p, p[hd], p[hd + 1], hd);
            }
            normalize(out_base + ((size_t)t * ap->n_head + (size_t)kvh * group + g) * hd, st->tot + (size_t)g * hd,
                      st->tot_sum[g], hd);
        }
    }
}

void pp_paged_attention_split_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    pp_attention_params *ap = userdata;
    const pp_batch *batch = ap->batch;
    const int hd = ap->head_dim;
    const int n_kv = ap->n_head_kv;
    const int group = ap->n_head / ap->n_head_kv;
    const int n_items = batch->n_tokens * n_kv;
    const int64_t out_floats = (int64_t)hd * ap->n_head * batch->n_tokens;
    const int n_splits = (int)((dst->ne[0] - out_floats) / ((int64_t)n_items * group * (hd + 2)));
    float *out = dst->data, *parts = out + out_floats;
    GGML_ASSERT(group <= PP_ATTN_MAX_ROWS);
    tile_state st;
    tile_state_init(&st, ap, ith, group);

    const int n_units = n_items * n_splits;
    for (int unit = ith; unit < n_units; unit += nth) {
        const int item = unit / n_splits, split = unit % n_splits;
        const int t = item / n_kv, kvh = item % n_kv;
        int k_begin, k_end;
        slice_keys(ap, batch->positions[t], split, &k_begin, &k_end);
        for (int g = 0; g < group; g++) slice_part(parts, item, split, g, n_splits, group, hd)[hd + 1] = 0.0f;
        if (k_begin >= k_end) continue;   /* past this token's last slice */
        attend_tile(ap, dst->src[0], dst->src[1], dst->src[2], t, t + 1, kvh, k_begin, k_end, 0, &st);
        for (int g = 0; g < group; g++) {
            float *p = slice_part(parts, item, split, g, n_splits, group, hd);
            memcpy(p, st.tot + (size_t)g * hd, sizeof(float) * hd);
            p[hd] = st.tot_max[g];
            p[hd + 1] = st.tot_sum[g];
        }
    }
    /* every thread of the op passes here once per step (the counter is reset with the step's
     * batch); acq_rel: the last one sees the others' slices */
    if (atomic_fetch_add_explicit(&ap->slices_done, 1, memory_order_acq_rel) == nth - 1)
        merge_slices(ap, parts, n_splits, out, &st);
}

int pp_paged_attention_splits(const pp_attention_params *ap, int n_threads) {
    const pp_batch *b = ap->batch;
    const int n_items = b->n_tokens * ap->n_head_kv;
    if (n_items <= 0 || n_items >= n_threads) return 1;
    int n_slices = 1;
    for (int t = 0; t < b->n_tokens; t++) {
        const int pos = b->positions[t];
        const int slices = pos / PP_ATTN_SLICE_KEYS - key_begin(ap, pos) / PP_ATTN_SLICE_KEYS + 1;
        if (slices > n_slices) n_slices = slices;
    }
    return n_slices;
}

struct ggml_tensor *pp_paged_attention(struct ggml_context *ctx, struct ggml_tensor *q,
                                       struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                       pp_attention_params *ap, int n_threads) {
    const pp_batch *b = ap->batch;
    const int n_items = b->n_tokens * ap->n_head_kv;
    const int n_splits = pp_paged_attention_splits(ap, n_threads);
    struct ggml_tensor *args[3] = {q, k_pool, v_pool};
    const int group = ap->n_head / ap->n_head_kv;
    if (n_splits == 1)
        return ggml_custom_4d(ctx, GGML_TYPE_F32, ap->head_dim, ap->n_head, b->n_tokens, 1, args, 3,
                              pp_paged_attention_cpu, GGML_N_TASKS_MAX, ap);
    const int64_t out_floats = (int64_t)ap->head_dim * ap->n_head * b->n_tokens;
    const int64_t part_floats = (int64_t)n_items * n_splits * group * (ap->head_dim + 2);
    struct ggml_tensor *both = ggml_custom_4d(ctx, GGML_TYPE_F32, out_floats + part_floats, 1, 1, 1, args, 3,
                                              pp_paged_attention_split_cpu, GGML_N_TASKS_MAX, ap);
    return ggml_view_3d(ctx, both, ap->head_dim, ap->n_head, b->n_tokens, sizeof(float) * ap->head_dim,
                        sizeof(float) * ap->head_dim * ap->n_head, 0);
}
