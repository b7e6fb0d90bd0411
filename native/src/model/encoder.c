/* An encoder-only model's compute context: the CPU backend with a thread
 * pool of its own, a graph allocator reused across calls, the padded batch
 * upload and the pooling of each input's token states. */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct pp_encoder {
    pp_model          *model;
    ggml_backend_t     backend;
    ggml_threadpool_t  threadpool;
    pid_t              pool_pid;     /* a forked child must not join its parent's workers */
    ggml_gallocr_t     galloc;
    void              *meta_buf;     /* graph metadata arena, reused each call */
    size_t             meta_size;
    int32_t            max_batch_tokens;
};

void pp_encoder_destroy(pp_encoder *e) {
    if (!e) return;
    pp_compute_release(e->galloc, e->backend, e->threadpool, e->pool_pid);
    free(e->meta_buf);
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
    e->meta_size = ggml_tensor_overhead() * PP_MAX_GRAPH_NODES + ggml_graph_overhead_custom(PP_MAX_GRAPH_NODES, false);
    e->meta_buf = malloc(e->meta_size);
    e->backend = ggml_backend_cpu_init();
    e->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    tpp.poll = 0;   /* idle workers sleep: the CPU between calls belongs to others */
    e->threadpool = ggml_threadpool_new(&tpp);
    e->pool_pid = getpid();
    if (!e->meta_buf || !e->backend || !e->galloc || !e->threadpool) {
        pp_encoder_destroy(e);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot set up the encoder's compute context");
    }
    ggml_backend_cpu_set_n_threads(e->backend, n_threads);
    ggml_backend_cpu_set_threadpool(e->backend, e->threadpool);
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
    if (e->threadpool && e->pool_pid != getpid()) {
        /* after fork(): the parent's workers do not exist here; run without a pool */
        ggml_backend_t backend = ggml_backend_cpu_init();
        if (!backend) return pp_fail(PP_ERR_NO_MEMORY, "cannot set up the compute backend after fork");
        ggml_backend_free(e->backend);
        e->backend = backend;
        e->threadpool = NULL;
    }
    struct ggml_init_params params = {.mem_size = e->meta_size, .mem_buffer = e->meta_buf, .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return pp_fail(PP_ERR_NO_MEMORY, "cannot create the graph context");
    struct ggml_cgraph *gf = pp_build_encoder_graph(ctx, e->model, n_seqs, max_len);
    if (!ggml_gallocr_alloc_graph(e->galloc, gf)) {
        ggml_free(ctx);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the compute buffer for %d inputs of %d tokens", n_seqs,
                       max_len);
    }
    upload(gf, ids, types, lens, n_seqs, max_len);
    enum ggml_status status = ggml_backend_graph_compute(e->backend, gf);
    if (status != GGML_STATUS_SUCCESS) {
        ggml_free(ctx);
        return pp_fail(PP_ERR_COMPUTE, "encoder graph compute failed with GGML status %d", (int)status);
    }
    pool(ggml_graph_get_tensor(gf, "hidden")->data, lens, n_seqs, max_len, e->model->hp.n_embd, pooling, out);
    ggml_free(ctx);
    return PP_OK;
}
