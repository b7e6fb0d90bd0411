/* An encoder-only model's compute context: the CPU backend with a thread
 * pool of its own, a graph allocator reused across calls, the padded batch
 * upload and the pooling of each input's token states. */
#include "common/engine_internal.h"
#include "common/cpu_compute.h"
#include "common/pp_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct pp_encoder {
    pp_model       *model;
    pp_cpu_compute  compute;
    int32_t         max_batch_tokens;
};

void pp_encoder_destroy(pp_encoder *e) {
    if (!e) return;
    pp_cpu_compute_release(&e->compute);
    free(e);
}

int32_t pp_encoder_create(pp_model *m, int32_t n_threads, int32_t max_batch_tokens, pp_encoder **out) {
    if (!m || !out) return pp_fail(PP_ERR_INVALID, "pp_encoder_create: NULL argument");
    *out = NULL;
    if (m->hp.arch != PP_ARCH_BERT) return pp_fail(PP_ERR_INVALID, "pp_encoder_create: not an encoder model");
    if (!m->finalized) return pp_fail(PP_ERR_INVALID, "model not finalized (missing tensors?)");
    if (n_threads < 1 || n_threads > GGML_MAX_N_THREADS || max_batch_tokens < 1)
        return pp_fail(PP_ERR_INVALID, "n_threads must be in [1, %d] and max_batch_tokens >= 1 (got %d, %d)",
                       GGML_MAX_N_THREADS, n_threads, max_batch_tokens);
    pp_encoder *e = calloc(1, sizeof *e);
    if (!e) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate an encoder context");
    e->model = m;
    e->max_batch_tokens = max_batch_tokens;
    const int32_t st = pp_cpu_compute_init(&e->compute, n_threads, PP_MAX_GRAPH_NODES);
    if (st != PP_OK) {
        free(e);
        return st;
    }
    *out = e;
    return PP_OK;
}

static int check_inputs(const pp_encoder *e, const int32_t *ids, const int32_t *types, const int32_t *lens,
                        int32_t n_seqs, int32_t pooling, int *max_len) {
    const pp_model_hparams *hp = &e->model->hp;
    const int n_types = hp->n_token_types > 0 ? hp->n_token_types : 2;
    if (n_seqs < 1 || !lens || !ids) return pp_fail(PP_ERR_INVALID, "pp_encoder_embed: no inputs");
    if (pooling < PP_POOLING_NONE || pooling > PP_POOLING_LAST)
        return pp_fail(PP_ERR_INVALID, "pooling %d unknown", pooling);
    *max_len = 0;
    int64_t at = 0;
    for (int s = 0; s < n_seqs; s++) {
        if (lens[s] < 1 || lens[s] > hp->n_ctx_train)
            return pp_fail(PP_ERR_INVALID, "input %d: %d tokens; the model takes 1 to %d", s, lens[s], hp->n_ctx_train);
        if (lens[s] > *max_len) *max_len = lens[s];
        for (int t = 0; t < lens[s]; t++, at++) {
            if (ids[at] < 0 || ids[at] >= hp->n_vocab)
                return pp_fail(PP_ERR_INVALID, "input %d: token id %d outside the vocabulary of %d", s, ids[at],
                               hp->n_vocab);
            if (types && (types[at] < 0 || types[at] >= n_types || (!e->model->tok_types && types[at] != 0)))
                return pp_fail(PP_ERR_INVALID, "input %d: token type %d outside [0, %d)", s, types[at],
                               e->model->tok_types ? n_types : 1);
        }
    }
    if ((int64_t)*max_len * n_seqs > e->max_batch_tokens)
        return pp_fail(PP_ERR_INVALID, "%d inputs padded to %d tokens exceed max_batch_tokens %d", n_seqs, *max_len,
                       e->max_batch_tokens);
    return PP_OK;
}

/* Copy the inputs into the padded layout: input s's token t at row s * max_len + t;
 * padding rows hold token 0 at position 0 and are masked out as keys. */
static void upload(struct ggml_cgraph *gf, const int32_t *ids, const int32_t *types, const int32_t *lens,
                   int n_seqs, int max_len) {
    int32_t *tok = ggml_graph_get_tensor(gf, "tokens")->data;
    int32_t *typ = ggml_graph_get_tensor(gf, "types")->data;
    int32_t *pos = ggml_graph_get_tensor(gf, "positions")->data;
    float *mask = ggml_graph_get_tensor(gf, "kq_mask")->data;
    int64_t at = 0;
    for (int s = 0; s < n_seqs; s++) {
        for (int t = 0; t < max_len; t++) {
            const int64_t row = (int64_t)s * max_len + t;
            const int real = t < lens[s];
            tok[row] = real ? ids[at + t] : 0;
            typ[row] = real && types ? types[at + t] : 0;
            pos[row] = real ? t : 0;
        }
        /* every query row of input s sees exactly its real keys */
        float *ms = mask + (int64_t)s * max_len * max_len;
        for (int q = 0; q < max_len; q++)
            for (int k = 0; k < max_len; k++) ms[(int64_t)q * max_len + k] = k < lens[s] ? 0.0f : -INFINITY;
        at += lens[s];
    }
}

static void pool(const float *hidden, const int32_t *lens, int n_seqs, int max_len, int n_embd, int pooling,
                 float *out) {
    int64_t out_row = 0;
    for (int s = 0; s < n_seqs; s++) {
        const float *base = hidden + (int64_t)s * max_len * n_embd;
        if (pooling == PP_POOLING_NONE) {
            memcpy(out + out_row * n_embd, base, sizeof(float) * (size_t)lens[s] * n_embd);
            out_row += lens[s];
            continue;
        }
        float *o = out + (int64_t)s * n_embd;
        if (pooling == PP_POOLING_CLS || pooling == PP_POOLING_LAST) {
            const int t = pooling == PP_POOLING_CLS ? 0 : lens[s] - 1;
            memcpy(o, base + (int64_t)t * n_embd, sizeof(float) * n_embd);
            continue;
        }
        /* mean, summed in double: long inputs lose no precision */
        for (int i = 0; i < n_embd; i++) {
            double sum = 0.0;
            for (int t = 0; t < lens[s]; t++) sum += base[(int64_t)t * n_embd + i];
            o[i] = (float)(sum / lens[s]);
        }
    }
}

int32_t pp_encoder_embed(pp_encoder *e, const int32_t *ids, const int32_t *types, const int32_t *lens, int32_t n_seqs,
                         int32_t pooling, float *out) {
    if (!e || !out) return pp_fail(PP_ERR_INVALID, "pp_encoder_embed: NULL argument");
    int max_len = 0;
    int st = check_inputs(e, ids, types, lens, n_seqs, pooling, &max_len);
    if (st != PP_OK) return st;
    struct ggml_context *ctx = pp_cpu_compute_begin(&e->compute);
    if (!ctx) return PP_ERR_NO_MEMORY;
    struct ggml_cgraph *gf = pp_build_encoder_graph(ctx, e->model, n_seqs, max_len);
    st = pp_cpu_compute_alloc(&e->compute, gf, "the encoder's inputs");
    if (st == PP_OK) {
        upload(gf, ids, types, lens, n_seqs, max_len);
        st = pp_cpu_compute_run(&e->compute, gf, "encoder");
    }
    if (st != PP_OK) {
        ggml_free(ctx);
        return st;
    }
    pool(ggml_graph_get_tensor(gf, "hidden")->data, lens, n_seqs, max_len, e->model->hp.n_embd, pooling, out);
    ggml_free(ctx);
    return PP_OK;
}
