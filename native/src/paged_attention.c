/* Paged attention on the CPU, run by GGML's thread pool as a custom op.
 *
 * For each (token, KV head) work item the kernel walks the token's sequence
 * through its block table, one page at a time, scoring every query head of
 * the GQA group against each key row (the row is read once for the whole
 * group) and folding the page into an online softmax (running max, running
 * sum, rescaled accumulator), so no score matrix is ever materialized.
 * Dot products use GGML's own per-ISA vec_dot for the cache type after the
 * query is converted to that type's vec_dot_type: SIMD comes from GGML. */
#include "engine_internal.h"
#include "ggml-cpu.h"

#include <math.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#define PP_ATTN_MAX_HEAD_DIM 512
#define PP_ATTN_MAX_GROUP    32
#define PP_ATTN_PAGE_CHUNK   64   /* keys scored before each softmax update */

/* f16 -> f32 of one V row. GGML's exported row converter is scalar in
 * ggml-base, and V conversion is the kernel's hot loop for f16 caches. */
static void v_row_to_f32(const ggml_to_float_t generic, enum ggml_type type, const void *src,
                         float *restrict dst, int n) {
#if defined(__F16C__) && defined(__AVX__)
    if (type == GGML_TYPE_F16) {
        const uint16_t *h = src;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        for (; i < n; i++) dst[i] = ggml_fp16_to_fp32(h[i]);
        return;
    }
#endif
    generic(src, dst, n);
}

static void axpy(float *restrict y, const float *restrict x, float a, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static void scale_row(float *restrict y, float a, int n) {
    for (int i = 0; i < n; i++) y[i] *= a;
}

/* Per-thread state of one (token, KV head) work item over a key range. */
typedef struct attn_state {
    char  q_conv[PP_ATTN_MAX_GROUP * (PP_ATTN_MAX_HEAD_DIM * 4)];
    float acc[PP_ATTN_MAX_GROUP * PP_ATTN_MAX_HEAD_DIM];
    float scores[PP_ATTN_MAX_GROUP * PP_ATTN_PAGE_CHUNK];
    float v_row[PP_ATTN_MAX_HEAD_DIM];
    float run_max[PP_ATTN_MAX_GROUP];
    float run_sum[PP_ATTN_MAX_GROUP];
} attn_state;

/* Fold keys [k_begin, k_end) of token t's sequence into st for KV head kvh:
 * st->acc holds the unnormalized sum, run_max/run_sum the softmax state. */
static void attend_range(const pp_attention_params *ap, const struct ggml_tensor *q,
                         const struct ggml_tensor *kc, const struct ggml_tensor *vc, int t, int kvh,
                         int k_begin, int k_end, attn_state *st) {
    const pp_batch *batch = ap->batch;
    const int head_dim = ap->head_dim;
    const int group = ap->n_head / ap->n_head_kv;
    const int bs = ap->block_size;
    const struct ggml_type_traits_cpu *k_traits = ggml_get_type_traits_cpu(kc->type);
    const enum ggml_type q_type = k_traits->vec_dot_type;
    const ggml_from_float_t q_convert = ggml_get_type_traits_cpu(q_type)->from_float;
    const ggml_to_float_t v_to_float = ggml_get_type_traits(vc->type)->to_float;
    const size_t q_row_bytes = ggml_row_size(q_type, head_dim);
    const size_t kv_head_bytes = ggml_row_size(kc->type, head_dim);
    const int32_t *table = batch->block_tables + (size_t)batch->seq_index[t] * batch->max_blocks_per_seq;

    for (int g = 0; g < group; g++) {
        const float *qrow = (const float *)((const char *)q->data + t * q->nb[2] +
                                            (size_t)(kvh * group + g) * q->nb[1]);
        q_convert(qrow, st->q_conv + g * q_row_bytes, head_dim);
        st->run_max[g] = -INFINITY;
        st->run_sum[g] = 0.0f;
    }
    memset(st->acc, 0, sizeof(float) * (size_t)group * head_dim);

    /* Walk the range in chunks that never cross a page boundary. */
    for (int k0 = k_begin; k0 < k_end;) {
        const int page_end = (k0 / bs + 1) * bs;
        int k1 = page_end < k_end ? page_end : k_end;
        if (k1 - k0 > PP_ATTN_PAGE_CHUNK) k1 = k0 + PP_ATTN_PAGE_CHUNK;
        const int n = k1 - k0;
        const int64_t slot0 = (int64_t)table[k0 / bs] * bs + k0 % bs;
        const char *krows = (const char *)kc->data + slot0 * kc->nb[1] + kvh * kv_head_bytes;
        const char *vrows = (const char *)vc->data + slot0 * vc->nb[1] + kvh * kv_head_bytes;

        for (int j = 0; j < n; j++) {
            for (int g = 0; g < group; g++) {
                float dot;
                k_traits->vec_dot(head_dim, &dot, 0, krows + j * kc->nb[1], 0,
                                  st->q_conv + g * q_row_bytes, 0, 1);
                st->scores[g * PP_ATTN_PAGE_CHUNK + j] = dot * ap->scale;
            }
        }
        for (int g = 0; g < group; g++) {
            float *sg = st->scores + g * PP_ATTN_PAGE_CHUNK;
            float m = st->run_max[g];
            for (int j = 0; j < n; j++) m = sg[j] > m ? sg[j] : m;
            const float correction = expf(st->run_max[g] - m);
            float sum = 0.0f;
            for (int j = 0; j < n; j++) {
                sg[j] = expf(sg[j] - m);
                sum += sg[j];
            }
            st->run_sum[g] = st->run_sum[g] * correction + sum;
            st->run_max[g] = m;
            if (correction != 1.0f) scale_row(st->acc + g * head_dim, correction, head_dim);
        }
        for (int j = 0; j < n; j++) {
            v_row_to_f32(v_to_float, vc->type, vrows + j * vc->nb[1], st->v_row, head_dim);
            for (int g = 0; g < group; g++)
                axpy(st->acc + g * head_dim, st->v_row, st->scores[g * PP_ATTN_PAGE_CHUNK + j], head_dim);
        }
        k0 = k1;
    }
}

static int key_begin(const pp_attention_params *ap, int pos) {
    return ap->window > 0 && pos - ap->window + 1 > 0 ? pos - ap->window + 1 : 0;
}

void pp_paged_attention_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const pp_attention_params *ap = userdata;
    const pp_batch *batch = ap->batch;
    const int head_dim = ap->head_dim;
    const int n_kv = ap->n_head_kv;
    const int group = ap->n_head / ap->n_head_kv;
    attn_state st;

    const int n_items = batch->n_tokens * n_kv;
    for (int item = ith; item < n_items; item += nth) {
        const int t = item / n_kv, kvh = item % n_kv;
        const int pos = batch->positions[t];
        attend_range(ap, dst->src[0], dst->src[1], dst->src[2], t, kvh, key_begin(ap, pos), pos + 1, &st);
        for (int g = 0; g < group; g++) {
            float *out = (float *)((char *)dst->data + t * dst->nb[2] +
                                   (size_t)(kvh * group + g) * dst->nb[1]);
            const float inv = st.run_sum[g] > 0.0f ? 1.0f / st.run_sum[g] : 0.0f;
            for (int d = 0; d < head_dim; d++) out[d] = st.acc[g * head_dim + d] * inv;
        }
    }
}

/* Split-K: work unit (item, split) folds one slice of the key range and
 * stores its unnormalized accumulator plus (max, sum) in dst, laid out as
 * [head_dim + 2, group, n_splits, n_items]. */
void pp_paged_attention_partial_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const pp_attention_params *ap = userdata;
    const pp_batch *batch = ap->batch;
    const int head_dim = ap->head_dim;
    const int n_kv = ap->n_head_kv;
    const int group = ap->n_head / ap->n_head_kv;
    const int n_splits = (int)dst->ne[2];
    attn_state st;

    const int n_units = batch->n_tokens * n_kv * n_splits;
    for (int unit = ith; unit < n_units; unit += nth) {
        const int item = unit / n_splits, split = unit % n_splits;
        const int t = item / n_kv, kvh = item % n_kv;
        const int pos = batch->positions[t];
        const int lo = key_begin(ap, pos), len = pos + 1 - lo;
        const int k_begin = lo + (int)((int64_t)len * split / n_splits);
        const int k_end = lo + (int)((int64_t)len * (split + 1) / n_splits);
        attend_range(ap, dst->src[0], dst->src[1], dst->src[2], t, kvh, k_begin, k_end, &st);
        for (int g = 0; g < group; g++) {
            float *out = (float *)((char *)dst->data + item * dst->nb[3] + split * dst->nb[2] + g * dst->nb[1]);
            memcpy(out, st.acc + g * head_dim, sizeof(float) * head_dim);
            out[head_dim] = st.run_max[g];
            out[head_dim + 1] = st.run_sum[g];
        }
    }
}

/* Merge the splits of each item by log-sum-exp into [head_dim, n_head, n_tokens]. */
void pp_paged_attention_merge_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const pp_attention_params *ap = userdata;
    const struct ggml_tensor *part = dst->src[0];
    const int head_dim = ap->head_dim;
    const int n_kv = ap->n_head_kv;
    const int group = ap->n_head / ap->n_head_kv;
    const int n_splits = (int)part->ne[2];
    const int n_items = ap->batch->n_tokens * n_kv;

    for (int item = ith; item < n_items; item += nth) {
        const int t = item / n_kv, kvh = item % n_kv;
        for (int g = 0; g < group; g++) {
            float m = -INFINITY;
            for (int s = 0; s < n_splits; s++) {
                const float *p = (const float *)((const char *)part->data + item * part->nb[3] +
                                                 s * part->nb[2] + g * part->nb[1]);
                if (p[head_dim] > m) m = p[head_dim];
            }
            float *out = (float *)((char *)dst->data + t * dst->nb[2] + (size_t)(kvh * group + g) * dst->nb[1]);
            memset(out, 0, sizeof(float) * head_dim);
            float total = 0.0f;
            for (int s = 0; s < n_splits; s++) {
                const float *p = (const float *)((const char *)part->data + item * part->nb[3] +
                                                 s * part->nb[2] + g * part->nb[1]);
                if (p[head_dim + 1] == 0.0f) continue;   /* empty slice */
                const float w = expf(p[head_dim] - m);
                total += p[head_dim + 1] * w;
                axpy(out, p, w, head_dim);
            }
            if (total > 0.0f) scale_row(out, 1.0f / total, head_dim);
        }
    }
}

struct ggml_tensor *pp_paged_attention(struct ggml_context *ctx, struct ggml_tensor *q,
                                       struct ggml_tensor *k_pool, struct ggml_tensor *v_pool,
                                       pp_attention_params *ap, int n_threads) {
    const pp_batch *b = ap->batch;
    const int n_items = b->n_tokens * ap->n_head_kv;
    int max_keys = 0;
    for (int t = 0; t < b->n_tokens; t++) {
        const int keys = b->positions[t] + 1 - key_begin(ap, b->positions[t]);
        if (keys > max_keys) max_keys = keys;
    }
    int n_splits = 1;
    if (n_items < n_threads) {
        n_splits = (n_threads + n_items - 1) / n_items;
        const int by_length = max_keys / PP_ATTN_MIN_SPLIT_KEYS;
        if (n_splits > by_length) n_splits = by_length > 1 ? by_length : 1;
    }
    struct ggml_tensor *args[3] = {q, k_pool, v_pool};
    const int group = ap->n_head / ap->n_head_kv;
    if (n_splits == 1)
        return ggml_custom_4d(ctx, GGML_TYPE_F32, ap->head_dim, ap->n_head, b->n_tokens, 1, args, 3,
                              pp_paged_attention_cpu, GGML_N_TASKS_MAX, ap);
    struct ggml_tensor *part = ggml_custom_4d(ctx, GGML_TYPE_F32, ap->head_dim + 2, group, n_splits,
                                              n_items, args, 3, pp_paged_attention_partial_cpu,
                                              GGML_N_TASKS_MAX, ap);
    return ggml_custom_4d(ctx, GGML_TYPE_F32, ap->head_dim, ap->n_head, b->n_tokens, 1, &part, 1,
                          pp_paged_attention_merge_cpu, GGML_N_TASKS_MAX, ap);
}
