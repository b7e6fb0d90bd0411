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

#define PP_ATTN_MAX_HEAD_DIM 512
#define PP_ATTN_MAX_GROUP    32
#define PP_ATTN_PAGE_CHUNK   64   /* keys scored before each softmax update */

static void axpy(float *restrict y, const float *restrict x, float a, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static void scale_row(float *restrict y, float a, int n) {
    for (int i = 0; i < n; i++) y[i] *= a;
}

void pp_paged_attention_cpu(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const pp_attention_params *ap = userdata;
    const pp_batch *batch = ap->batch;
    const struct ggml_tensor *q = dst->src[0];
    const struct ggml_tensor *kc = dst->src[1];
    const struct ggml_tensor *vc = dst->src[2];

    const int head_dim = ap->head_dim;
    const int n_kv = ap->n_head_kv;
    const int group = ap->n_head / ap->n_head_kv;
    const int bs = ap->block_size;
    const int n_tokens = batch->n_tokens;

    const struct ggml_type_traits_cpu *k_traits = ggml_get_type_traits_cpu(kc->type);
    const enum ggml_type q_type = k_traits->vec_dot_type;
    const ggml_from_float_t q_convert = ggml_get_type_traits_cpu(q_type)->from_float;
    const ggml_to_float_t v_to_float = ggml_get_type_traits(vc->type)->to_float;
    const size_t q_row_bytes = ggml_row_size(q_type, head_dim);
    const size_t kv_head_bytes = ggml_row_size(kc->type, head_dim);

    /* Per-thread scratch on the stack: sizes are bounded by the model checks. */
    char q_conv[PP_ATTN_MAX_GROUP * (PP_ATTN_MAX_HEAD_DIM * 4)];
    float acc[PP_ATTN_MAX_GROUP * PP_ATTN_MAX_HEAD_DIM];
    float scores[PP_ATTN_MAX_GROUP * PP_ATTN_PAGE_CHUNK];
    float v_row[PP_ATTN_MAX_HEAD_DIM];
    float run_max[PP_ATTN_MAX_GROUP], run_sum[PP_ATTN_MAX_GROUP];

    const int n_items = n_tokens * n_kv;
    for (int item = ith; item < n_items; item += nth) {
        const int t = item / n_kv;
        const int kvh = item % n_kv;
        const int s = batch->seq_index[t];
        const int pos = batch->positions[t];
        const int lo = ap->window > 0 && pos - ap->window + 1 > 0 ? pos - ap->window + 1 : 0;
        const int32_t *table = batch->block_tables + (size_t)s * batch->max_blocks_per_seq;

        for (int g = 0; g < group; g++) {
            const float *qrow = (const float *)((const char *)q->data + t * q->nb[2] +
                                                (size_t)(kvh * group + g) * q->nb[1]);
            q_convert(qrow, q_conv + g * q_row_bytes, head_dim);
            run_max[g] = -INFINITY;
            run_sum[g] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)group * head_dim);

        /* Walk [lo, pos] in chunks that never cross a page boundary. */
        for (int k0 = lo; k0 <= pos;) {
            const int page_end = (k0 / bs + 1) * bs;
            int k1 = page_end < pos + 1 ? page_end : pos + 1;
            if (k1 - k0 > PP_ATTN_PAGE_CHUNK) k1 = k0 + PP_ATTN_PAGE_CHUNK;
            const int n = k1 - k0;
            const int64_t slot0 = (int64_t)table[k0 / bs] * bs + k0 % bs;
            const char *krows = (const char *)kc->data + slot0 * kc->nb[1] + kvh * kv_head_bytes;
            const char *vrows = (const char *)vc->data + slot0 * vc->nb[1] + kvh * kv_head_bytes;

            for (int j = 0; j < n; j++) {
                for (int g = 0; g < group; g++) {
                    float dot;
                    k_traits->vec_dot(head_dim, &dot, 0, krows + j * kc->nb[1], 0,
                                      q_conv + g * q_row_bytes, 0, 1);
                    scores[g * PP_ATTN_PAGE_CHUNK + j] = dot * ap->scale;
                }
            }
            for (int g = 0; g < group; g++) {
                float *sg = scores + g * PP_ATTN_PAGE_CHUNK;
                float m = run_max[g];
                for (int j = 0; j < n; j++) m = sg[j] > m ? sg[j] : m;
                const float correction = expf(run_max[g] - m);
                float sum = 0.0f;
                for (int j = 0; j < n; j++) {
                    sg[j] = expf(sg[j] - m);
                    sum += sg[j];
                }
                run_sum[g] = run_sum[g] * correction + sum;
                run_max[g] = m;
                if (correction != 1.0f) scale_row(acc + g * head_dim, correction, head_dim);
            }
            for (int j = 0; j < n; j++) {
                v_to_float(vrows + j * vc->nb[1], v_row, head_dim);
                for (int g = 0; g < group; g++)
                    axpy(acc + g * head_dim, v_row, scores[g * PP_ATTN_PAGE_CHUNK + j], head_dim);
            }
            k0 = k1;
        }

        for (int g = 0; g < group; g++) {
            float *out = (float *)((char *)dst->data + t * dst->nb[2] +
                                   (size_t)(kvh * group + g) * dst->nb[1]);
            const float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;
            for (int d = 0; d < head_dim; d++) out[d] = acc[g * head_dim + d] * inv;
        }
    }
}
