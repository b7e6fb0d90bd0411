/* One compute context: the CPU backend (GGML's thread pool), the graph
 * allocator reused across steps, and the per-step input upload. A model
 * offloaded to a device (device.c) runs its graphs through GGML's
 * scheduler instead: the device's backend first, the CPU's as fallback. */
#include "common/engine_internal.h"
#include "kernels/attention_math.h"
#include "common/pp_internal.h"
#include "panels/panels.h"
#include "model/lora.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* What a step's graph depends on besides the model: equal shapes, equal graphs. */
typedef struct step_shape {
    int32_t  n_tokens, n_logits, n_hidden, path, n_threads, argmax;
    int32_t  n_embd_rows;  /* rows given as embeddings: their inputs are nodes of their own */
    int32_t  reusable;     /* 0: slabs, whose views move with each sequence's length */
    uint64_t attention;    /* the attention nodes' shapes (flash plan, kernel splits) */
    uint64_t lora;         /* the LoRA nodes' (pp_lora_plan_shape; 0: none) */
} step_shape;

struct pp_context {
    pp_model            *model;
    pp_kv_cache         *cache;
    ggml_backend_t       backend;
    ggml_threadpool_t    threadpool;   /* persistent workers (GGML would spawn them per graph) */
    pid_t                pool_pid;     /* the process whose threads those are (see fork below) */
    ggml_gallocr_t       galloc;
    void                *meta_buf;     /* graph metadata arena, reused each step */
    size_t               meta_size;
    size_t               max_nodes;       /* pp_graph_capacity: the graph, its tensors and the scheduler */
    int32_t              max_batch_tokens;
    int32_t              n_threads;
    pp_attention_params *layer_params;
    pp_panel_gemm_state *gemm_states;   /* per model panel slot (NULL: the model has no panels) */
    pp_attention_scratch scratch;      /* the kernel's tiles, one slice per thread */
    int32_t              attention_path;   /* enum pp_attention_path */
    atomic_int           abort_requested;
    const float         *step_logits;  /* the last step's logits in the compute buffer, or NULL */
    int32_t              step_n_logits;
    int32_t              argmax_mode;  /* enum pp_argmax_mode */
    int32_t             *step_ids;     /* the last step's argmax ids (max_batch_tokens), if computed */
    int32_t              step_n_ids;
    ggml_backend_t       device_backend;   /* NULL: the model runs on the CPU alone */
    ggml_backend_sched_t sched;
    float               *host_logits;      /* a device's logits read back (sched only) */
    size_t               host_logits_floats;
    pp_flash_plan        plan;             /* this step's runs for GGML's flash attention */
    int32_t             *plan_arrays;      /* the plan's arrays, sized for max_batch_tokens */
    /* The last step's graph, kept allocated: a step of the same shape runs it
     * again (no build, no allocation, no scheduling: what a device replays). */
    struct ggml_context *graph_ctx;
    struct ggml_cgraph  *graph;
    step_shape           graph_shape;
    /* its inputs and outputs, looked up by name once per build (a lookup compares
     * the name with every node's: hundreds of strcmp a step otherwise) */
    struct ggml_tensor  *in_tokens, *in_positions, *in_slots, *in_rows;
    struct ggml_tensor  *in_mrope, *in_state_slots;   /* hybrids' */
    struct ggml_tensor  *out_logits, *out_argmax, *out_hidden;
    pp_step_stats        stats;
    pp_lora_plan        *lora_plan;    /* NULL until pp_context_reserve_loras */
    /* Hybrids: the pool holding the sequences' recurrent states (borrowed), a slot mark per
     * pool slot for the batch check, and this step's delta-rule segments. */
    pp_state_pool       *state_pool;
    uint8_t             *slot_seen;
    pp_delta_plan        delta_plan;
};

/* GGML asks between graph nodes whether to stop (ggml_abort_callback). */
static bool abort_requested(void *data) {
    pp_context *c = data;
    return atomic_load(&c->abort_requested) != 0;
}

static ggml_backend_t new_backend(pp_context *c) {
    ggml_backend_t backend = ggml_backend_cpu_init();
    if (backend) ggml_backend_cpu_set_abort_callback(backend, abort_requested, c);
    return backend;
}

int32_t pp_context_create(pp_model *m, pp_kv_cache *cache, int32_t n_threads,
                          int32_t max_batch_tokens, pp_context **out) {
    if (!m || !cache || !out) return pp_fail(PP_ERR_INVALID, "pp_context_create: NULL argument");
    *out = NULL;
    if (!m->finalized) return pp_fail(PP_ERR_INVALID, "model not finalized (missing tensors?)");
    if (m->hp.arch == PP_ARCH_BERT)
        return pp_fail(PP_ERR_INVALID, "an encoder-only model has no decoding context: use pp_encoder_create");
    if (cache->model != m) return pp_fail(PP_ERR_INVALID, "KV cache was made for another model");
    if (n_threads < 1 || max_batch_tokens < 1)
        return pp_fail(PP_ERR_INVALID, "n_threads and max_batch_tokens must be >= 1 (got %d, %d)",
                       n_threads, max_batch_tokens);
    pp_context *c = calloc(1, sizeof *c);
    if (!c) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a context");
    c->model = m;
    c->cache = cache;
    c->max_batch_tokens = max_batch_tokens;
    /* Sized for a step of single-token sequences on the flash-attention path;
     * the buffer is touched only as far as a step's graph reaches. */
    c->max_nodes = pp_graph_capacity(m->hp.n_layer, max_batch_tokens);
    if (m->n_recurrent > 0) {
        const int segments = max_batch_tokens < PP_MAX_DELTA_SEGMENTS ? max_batch_tokens : PP_MAX_DELTA_SEGMENTS;
        c->max_nodes += (size_t)m->n_recurrent * (size_t)segments * PP_DELTA_NODES_PER_SEGMENT;
    }
    c->meta_size = ggml_tensor_overhead() * c->max_nodes + ggml_graph_overhead_custom(c->max_nodes, false);
    c->meta_buf = malloc(c->meta_size);
    c->layer_params = calloc((size_t)m->hp.n_layer, sizeof *c->layer_params);
    c->plan_arrays = malloc(sizeof(int32_t) * ((size_t)max_batch_tokens * 7 + 1));
    c->step_ids = malloc(sizeof(int32_t) * (size_t)max_batch_tokens);
    if (c->plan_arrays) {
        int32_t *a = c->plan_arrays;
        const size_t n = (size_t)max_batch_tokens;
        c->plan.run_t0 = a, c->plan.run_nq = a + n, c->plan.order = a + 2 * n, c->plan.group_nq = a + 3 * n;
        c->plan.group_kv = a + 4 * n, c->plan.group_first = a + 6 * n;   /* group_kv: 2 n; group_first: n + 1 */
    }
    c->backend = new_backend(c);
    c->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (!c->meta_buf || !c->layer_params || !c->plan_arrays || !c->step_ids || !c->backend || !c->galloc) {
        pp_context_destroy(c);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot set up the compute context");
    }
    ggml_backend_dev_t device = pp_model_device(m);
    if (device) {
        c->device_backend = ggml_backend_dev_init(device, NULL);
        if (!c->device_backend) {
            pp_context_destroy(c);
            return pp_fail(PP_ERR_INVALID, "device %s: GGML cannot start its backend", ggml_backend_dev_name(device));
        }
        /* The device first: ops go where their weights and pools are, the CPU takes the rest. */
        ggml_backend_t backends[2] = {c->device_backend, c->backend};
        c->sched = ggml_backend_sched_new(backends, NULL, 2, c->max_nodes, false, false);
        if (!c->sched) {
            pp_context_destroy(c);
            return pp_fail(PP_ERR_NO_MEMORY, "cannot set up GGML's scheduler for device %s",
                           ggml_backend_dev_name(device));
        }
    }
    int st = pp_context_set_threads(c, n_threads);
    if (st != PP_OK) {
        pp_context_destroy(c);
        return st;
    }
    for (int il = 0; il < m->hp.n_layer; il++) {
        pp_attention_params *ap = &c->layer_params[il];
        ap->block_size = cache->block_size;
        ap->window = m->layer_window[il];
        ap->group = cache->layer_group[il];
        ap->scale = m->hp.attn_scale;
        ap->n_head = m->hp.n_head;
        ap->n_head_kv = pp_layer_n_head_kv(m, il);
        ap->head_dim = pp_layer_head_dim(m, il);   /* at most hp.head_dim, which sizes the scratch */
        ap->scratch = &c->scratch;
        ap->plan = &c->plan;
        const struct ggml_tensor *sinks = m->layers[il].attn_sinks;
        ap->sinks_tensor = m->layers[il].attn_sinks;
        /* a weight left in the caller's mapping has no buffer: host memory too */
        ap->sinks = sinks && (!sinks->buffer || ggml_backend_buffer_is_host(sinks->buffer)) ? sinks->data : NULL;
    }
    if (m->panels) {
        /* aligned: each thread's range of a state is a cache line of its own */
        const size_t bytes = (size_t)m->n_panel_slots * sizeof *c->gemm_states;
        c->gemm_states = aligned_alloc(_Alignof(pp_panel_gemm_state), bytes);
        if (c->gemm_states) memset(c->gemm_states, 0, bytes);
        if (!c->gemm_states) {
            pp_context_destroy(c);
            return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the panel GEMM states");
        }
        for (int i = 0; i < m->n_panel_slots; i++) {
            c->gemm_states[i].w = m->panels[i];
            c->gemm_states[i].experts = m->expert_panels ? m->expert_panels[i] : NULL;
            c->gemm_states[i].kernel = pp_panel_kernel_select();
        }
    }
    *out = c;
    return PP_OK;
}

void pp_compute_release(ggml_gallocr_t galloc, ggml_backend_t backend, ggml_threadpool_t threadpool,
                        pid_t pool_pid) {
    if (galloc) ggml_gallocr_free(galloc);
    if (backend) ggml_backend_free(backend);
    if (threadpool && pool_pid == getpid()) ggml_threadpool_free(threadpool);
}

void pp_context_destroy(pp_context *c) {
    if (!c) return;
    if (c->sched) ggml_backend_sched_free(c->sched);
    if (c->device_backend) ggml_backend_free(c->device_backend);
    free(c->host_logits);
    pp_compute_release(c->galloc, c->backend, c->threadpool, c->pool_pid);
    if (c->graph_ctx) ggml_free(c->graph_ctx);
    free(c->meta_buf);
    free(c->plan_arrays);
    free(c->step_ids);
    free(c->layer_params);
    free(c->gemm_states);
    pp_lora_plan_destroy(c->lora_plan);
    free(c->slot_seen);
    pp_attention_scratch_release(&c->scratch);
    free(c);
}

/* After fork() the child has the pool's memory but none of its threads:
 * joining or even pausing it could hang. The child gets a fresh backend
 * (freeing the old one touches only its own buffers) and leaves the
 * parent's pool struct alone. */
static int forget_parent_pool(pp_context *c) {
    if (!c->threadpool || c->pool_pid == getpid()) return PP_OK;
    /* GGML's device backends do not survive fork() (the scheduler holds the parent's backends). */
    if (c->sched) return pp_fail(PP_ERR_INVALID, "a forked process cannot use its parent's device context");
    ggml_backend_t backend = new_backend(c);
    if (!backend) return pp_fail(PP_ERR_NO_MEMORY, "cannot set up the compute backend after fork");
    ggml_backend_free(c->backend);
    c->backend = backend;
    c->threadpool = NULL;
    return PP_OK;
}

int32_t pp_context_set_threads(pp_context *c, int32_t n_threads) {
    if (!c || n_threads < 1) return pp_fail(PP_ERR_INVALID, "n_threads must be >= 1");
    if (n_threads > GGML_MAX_N_THREADS)
        return pp_fail(PP_ERR_INVALID, "n_threads %d above GGML's limit of %d", n_threads, GGML_MAX_N_THREADS);
    int st = forget_parent_pool(c);
    if (st != PP_OK) return st;
    if (c->threadpool && c->n_threads == n_threads) return PP_OK;
    st = pp_attention_scratch_init(&c->scratch, c->model->hp.head_dim, n_threads);
    if (st != PP_OK) return st;
    /* Without a pool of its own GGML creates and joins its worker threads
     * on every graph, i.e. every step. */
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    /* Idle workers sleep instead of spinning between graphs: in a server the
     * CPU between steps belongs to the HTTP and sampling threads. Measured
     * in one process, polling did not make generation faster. */
    tpp.poll = 0;
    ggml_threadpool_t pool = ggml_threadpool_new(&tpp);
    if (!pool) {
        /* Keep the scratch big enough for the old pool (it may have fewer slices now). */
        if (c->threadpool) pp_attention_scratch_init(&c->scratch, c->model->hp.head_dim, c->n_threads);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot start a pool of %d threads", n_threads);
    }
    ggml_backend_cpu_set_n_threads(c->backend, n_threads);
    ggml_backend_cpu_set_threadpool(c->backend, pool);   /* pauses the previous pool */
    if (c->threadpool) ggml_threadpool_free(c->threadpool);
    c->threadpool = pool;
    c->pool_pid = getpid();
    c->n_threads = n_threads;
    return PP_OK;
}

int32_t pp_check_token_order(const pp_batch *b, int i) {
    const int s = b->seq_index[i];
    if (s < 0 || s >= b->n_seqs)
        return pp_fail(PP_ERR_INVALID, "token %d: sequence index %d outside [0, %d)", i, s, b->n_seqs);
    if (i > 0 && s != b->seq_index[i - 1]) {
        for (int j = 0; j < i; j++)
            if (b->seq_index[j] == s)
                return pp_fail(PP_ERR_INVALID, "tokens of sequence %d are not contiguous", s);
    } else if (i > 0 && b->positions[i] <= b->positions[i - 1]) {
        return pp_fail(PP_ERR_INVALID, "token %d: positions of a sequence must increase", i);
    }
    return PP_OK;
}

/* The blocks group g's queries of tokens [t0, t1) (one sequence's run) read
 * are all present, and each token's slot is its block table's. */
static int check_group_run(const pp_kv_cache *cache, const pp_batch *b, int32_t g, int32_t window,
                           int t0, int t1) {
    const int64_t bs = cache->block_size;
    const size_t table_stride = (size_t)b->n_seqs * b->max_blocks_per_seq;
    const int32_t *table = b->block_tables + g * table_stride + (size_t)b->seq_index[t0] * b->max_blocks_per_seq;
    const int32_t *slots = b->slot_mapping + (size_t)g * b->n_tokens;
    const int first_pos = b->positions[t0], last_pos = b->positions[t1 - 1];
    const int first_key = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    for (int blk = (int)(first_key / bs); blk <= last_pos / bs; blk++)
        if (table[blk] < 0)
            return pp_fail(PP_ERR_INVALID, "token %d: group %d has no block for position %d", t0, g, blk * (int)bs);
    for (int i = t0; i < t1; i++) {
        const int pos = b->positions[i];
        if (slots[i] != table[pos / bs] * bs + pos % bs)
            return pp_fail(PP_ERR_INVALID, "token %d: slot %d does not match group %d's block table", i, slots[i], g);
    }
    return PP_OK;
}

int32_t pp_check_batch(const pp_model *m, const pp_kv_cache *cache, const pp_batch *b) {
    if (!b || b->n_tokens < 1 || !b->token_ids || !b->positions || !b->slot_mapping ||
        !b->seq_index || !b->block_tables || b->n_seqs < 1 || b->max_blocks_per_seq < 1 ||
        b->n_logits < 0 || (b->n_logits > 0 && !b->logit_rows))
        return pp_fail(PP_ERR_INVALID, "malformed batch (empty or missing arrays)");
    const int32_t n_groups = b->n_groups > 0 ? b->n_groups : 1;
    if (n_groups != cache->n_groups)
        return pp_fail(PP_ERR_INVALID, "batch of %d layer groups for a KV cache of %d", n_groups, cache->n_groups);
    for (size_t i = 0; i < (size_t)n_groups * b->n_seqs * b->max_blocks_per_seq; i++)
        if (b->block_tables[i] < -1 || b->block_tables[i] >= cache->num_blocks)
            return pp_fail(PP_ERR_INVALID, "block table entry %zu = %d outside the pool of %d blocks",
                           i, b->block_tables[i], cache->num_blocks);
    /* The window each group's layers attend over (all layers of a group share it). */
    int32_t group_window[256] = {0};
    for (int il = 0; il < m->hp.n_layer; il++) group_window[cache->layer_group[il]] = m->layer_window[il];
    const int64_t bs = cache->block_size;
    for (int i = 0; i < b->n_tokens; i++) {
        const int s = b->seq_index[i], pos = b->positions[i];
        if (b->token_ids[i] < 0 || b->token_ids[i] >= m->hp.n_vocab)
            return pp_fail(PP_ERR_INVALID, "token %d: id %d outside the vocabulary of %d", i,
                           b->token_ids[i], m->hp.n_vocab);
        const int order = pp_check_token_order(b, i);
        if (order != PP_OK) return order;
        if (pos < 0 || pos / bs >= b->max_blocks_per_seq)
            return pp_fail(PP_ERR_INVALID, "token %d: position %d beyond the block table", i, pos);
        if (!cache->paged) {
            const int32_t *table = b->block_tables + (size_t)s * b->max_blocks_per_seq;
            if (table[0] < 0 || pos >= bs)
                return pp_fail(PP_ERR_INVALID, "token %d: position %d outside its slab of %d", i, pos, (int)bs);
            if (b->slot_mapping[i] != table[0] * bs + pos)
                return pp_fail(PP_ERR_INVALID, "token %d: slot %d does not match its slab", i,
                               b->slot_mapping[i]);
        }
    }
    /* Paged: per sequence run and group, the blocks its queries read and its slots. */
    for (int t0 = 0; cache->paged && t0 < b->n_tokens;) {
        int t1 = t0 + 1;
        while (t1 < b->n_tokens && b->seq_index[t1] == b->seq_index[t0]) t1++;
        for (int32_t g = 0; g < n_groups; g++) {
            const int st = check_group_run(cache, b, g, group_window[g], t0, t1);
            if (st != PP_OK) return st;
        }
        t0 = t1;
    }
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens)
            return pp_fail(PP_ERR_INVALID, "logit row %d outside the batch of %d tokens",
                           b->logit_rows[i], b->n_tokens);
    if (b->n_embd_rows < 0 || b->n_embd_rows > b->n_tokens || (b->n_embd_rows > 0 && (!b->embd_rows || !b->embd)))
        return pp_fail(PP_ERR_INVALID, "malformed batch: %d embedding rows without their arrays", b->n_embd_rows);
    for (int i = 0; i < b->n_embd_rows; i++)
        if (b->embd_rows[i] < 0 || b->embd_rows[i] >= b->n_tokens || (i > 0 && b->embd_rows[i] <= b->embd_rows[i - 1]))
            return pp_fail(PP_ERR_INVALID, "embedding row %d: %d is outside the batch of %d tokens or not increasing",
                           i, b->embd_rows[i], b->n_tokens);
    if (b->n_hidden < 0 || (b->n_hidden > 0 && (!b->hidden_rows || !b->hidden)))
        return pp_fail(PP_ERR_INVALID, "malformed batch: %d hidden rows without their arrays", b->n_hidden);
    for (int i = 0; i < b->n_hidden; i++)
        if (b->hidden_rows[i] < 0 || b->hidden_rows[i] >= b->n_tokens)
            return pp_fail(PP_ERR_INVALID, "hidden row %d outside the batch of %d tokens",
                           b->hidden_rows[i], b->n_tokens);
    return PP_OK;
}

int32_t pp_context_set_argmax(pp_context *c, int32_t mode) {
    if (!c) return pp_fail(PP_ERR_INVALID, "pp_context_set_argmax: context is NULL");
    if (mode != PP_ARGMAX_ON_DEVICE && mode != PP_ARGMAX_ALWAYS && mode != PP_ARGMAX_NEVER)
        return pp_fail(PP_ERR_INVALID, "unknown argmax mode %d", mode);
    c->argmax_mode = mode;
    return PP_OK;
}

/* Whether steps compute argmax ids: the output head's weights on a device, or asked. */
static int computes_argmax(const pp_context *c) {
    if (c->argmax_mode != PP_ARGMAX_ON_DEVICE) return c->argmax_mode == PP_ARGMAX_ALWAYS;
    const struct ggml_tensor *head = c->model->output ? c->model->output : c->model->tok_embd;
    return head->buffer && !ggml_backend_buffer_is_host(head->buffer);
}

int32_t pp_context_set_attention_path(pp_context *c, int32_t path) {
    if (!c) return pp_fail(PP_ERR_INVALID, "pp_context_set_attention_path: context is NULL");
    if (path != PP_ATTENTION_KERNEL && path != PP_ATTENTION_GATHER)
        return pp_fail(PP_ERR_INVALID, "unknown attention path %d", path);
    c->attention_path = path;
    return PP_OK;
}

/* The step's inputs into the graph's input tensors (host memory: GGML's
 * scheduler keeps inputs on the CPU and copies what a device reads). */
static int32_t upload_inputs(pp_context *c, struct ggml_cgraph *gf, const pp_batch *b, int flash, int swa_window) {
    ggml_backend_tensor_set(c->in_tokens, b->token_ids, 0, sizeof(int32_t) * b->n_tokens);
    /* a hybrid's rope reads mrope_positions instead */
    if (c->in_positions) ggml_backend_tensor_set(c->in_positions, b->positions, 0, sizeof(int32_t) * b->n_tokens);
    struct ggml_tensor *slots = c->in_slots, *rows = c->in_rows;
    if (!ggml_backend_buffer_is_host(slots->buffer) || !ggml_backend_buffer_is_host(rows->buffer) ||
        (c->in_mrope && !ggml_backend_buffer_is_host(c->in_mrope->buffer)) ||
        (c->in_state_slots && !ggml_backend_buffer_is_host(c->in_state_slots->buffer)))
        return pp_fail(PP_ERR_COMPUTE, "GGML placed the step's inputs outside host memory");
    int64_t *slot_data = slots->data;
    for (int i = 0; i < b->n_tokens * c->cache->n_groups; i++) slot_data[i] = b->slot_mapping[i];
    int32_t *out_rows = rows->data;
    if (b->n_logits > 0) memcpy(out_rows, b->logit_rows, sizeof(int32_t) * b->n_logits);
    if (b->n_hidden > 0) memcpy(out_rows + b->n_logits, b->hidden_rows, sizeof(int32_t) * b->n_hidden);
    if (flash) pp_fill_flash_inputs(gf, b, &c->plan, swa_window, c->cache);
    pp_lora_plan_upload(c->lora_plan);
    if (b->n_embd_rows > 0) {
        struct ggml_tensor *embd = ggml_graph_get_tensor(gf, "embd_in"), *at = ggml_graph_get_tensor(gf, "embd_rows");
        if (!ggml_backend_buffer_is_host(at->buffer))
            return pp_fail(PP_ERR_COMPUTE, "GGML placed the step's inputs outside host memory");
        ggml_backend_tensor_set(embd, b->embd, 0, sizeof(float) * (size_t)b->n_embd_rows * c->model->hp.n_embd);
        int64_t *rows = at->data;
        for (int i = 0; i < b->n_embd_rows; i++) rows[i] = b->embd_rows[i];
    }
    if (c->in_mrope) {
        /* IMRoPE's components of a text token: its position three times, then 0 (llama.cpp's) */
        int32_t *pos = c->in_mrope->data;
        for (int i = 0; i < b->n_tokens; i++) {
            pos[i] = pos[b->n_tokens + i] = pos[2 * b->n_tokens + i] = b->positions[i];
            pos[3 * b->n_tokens + i] = 0;
        }
    }
    if (c->in_state_slots) {   /* each run's slot, in run order */
        int32_t *slots = c->in_state_slots->data;
        for (int t = 0, r = 0; t < b->n_tokens; t++)
            if (t == 0 || b->seq_index[t] != b->seq_index[t - 1]) slots[r++] = b->state_slots[b->seq_index[t]];
    }
    return PP_OK;
}

/* Whether some layer's attention is our CPU operator, the one node whose build reads the
 * thread count (its tasks and split-K choice). */
static int graph_reads_threads(const pp_context *c, int gather) {
    if (!c->cache->paged || gather) return 0;
    for (int il = 0; il < c->model->hp.n_layer; il++)
        if (!pp_pool_on_device(c->cache, c->cache->k[il])) return 1;
    return 0;
}

/* The step's shape: what its graph's nodes and their sizes depend on. The thread count
 * only where a node reads it: a device's graph (and the gather path's) is the same at any
 * count, so a step on another number of threads runs it again (a device keeps replaying). */
static step_shape shape_of(pp_context *c, const pp_batch *b, int gather, int flash) {
    const int threads = graph_reads_threads(c, gather);
    step_shape s = {.n_tokens = b->n_tokens, .n_logits = b->n_logits, .n_hidden = b->n_hidden,
                    .n_embd_rows = b->n_embd_rows,
                    .path = gather, .n_threads = threads ? c->n_threads : 0, .reusable = c->cache->paged,
                    .argmax = b->n_logits > 0 && computes_argmax(c)};
    uint64_t h = flash ? pp_flash_plan_shape(&c->plan) : 0;
    if (c->model->n_recurrent > 0) h = (h ^ pp_delta_plan_shape(&c->delta_plan)) * 1099511628211ull;
    /* Our kernel's split-K choice is made per layer when the graph is built. */
    const int32_t *recurrent = c->model->layer_recurrent;
    for (int il = 0; threads && il < c->model->hp.n_layer; il++)
        if (!recurrent || !recurrent[il])
            h = (h ^ (uint64_t)pp_paged_attention_splits(&c->layer_params[il], c->n_threads)) * 1099511628211ull;
    s.attention = h;
    s.lora = pp_lora_plan_shape(c->lora_plan);
    return s;
}

static int same_shape(const step_shape *a, const step_shape *b) {
    return a->reusable && b->reusable && a->n_tokens == b->n_tokens && a->n_logits == b->n_logits &&
           a->n_hidden == b->n_hidden && a->n_embd_rows == b->n_embd_rows && a->path == b->path &&
           a->n_threads == b->n_threads && a->argmax == b->argmax && a->attention == b->attention && a->lora == b->lora;
}

static void forget_graph(pp_context *c) {
    if (c->graph_ctx) ggml_free(c->graph_ctx);
    c->graph_ctx = NULL;
    c->graph = NULL;
    c->in_tokens = c->in_positions = c->in_slots = c->in_rows = c->in_mrope = c->in_state_slots = NULL;
    c->out_logits = c->out_argmax = c->out_hidden = NULL;
}

int32_t pp_context_set_state_pool(pp_context *c, pp_state_pool *pool) {
    if (!c || !pool) return pp_fail(PP_ERR_INVALID, "pp_context_set_state_pool: NULL argument");
    if (pool->model != c->model) return pp_fail(PP_ERR_INVALID, "the state pool was made for another model");
    uint8_t *seen = calloc((size_t)pool->num_slots, 1);
    if (!seen) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the state slots' marks");
    free(c->slot_seen);
    c->slot_seen = seen;
    c->state_pool = pool;
    forget_graph(c);   /* the last graph reads and writes the old pool's tensors */
    return PP_OK;
}

/* A hybrid step's state slots: one per sequence row, in range, taken, no two alike. */
static int32_t check_state_slots(pp_context *c, const pp_batch *b) {
    const pp_state_pool *pool = c->state_pool;
    if (!pool) return pp_fail(PP_ERR_INVALID, "a hybrid model's context needs a state pool (pp_context_set_state_pool)");
    if (!b->state_slots) return pp_fail(PP_ERR_INVALID, "a hybrid model's batch needs state_slots");
    int32_t st = PP_OK;
    int s = 0;
    for (; s < b->n_seqs && st == PP_OK; s++) {
        const int32_t slot = b->state_slots[s];
        if (slot < 0 || slot >= pool->num_slots || !pool->taken[slot])
            st = pp_fail(PP_ERR_INVALID, "sequence %d: state slot %d is not a taken slot of the pool of %d", s, slot,
                         pool->num_slots);
        else if (c->slot_seen[slot])
            st = pp_fail(PP_ERR_INVALID, "sequence %d: state slot %d is another sequence's too", s, slot);
        else
            c->slot_seen[slot] = 1;
    }
    while (s-- > 0) {   /* clear the marks set (a failing slot set none) */
        const int32_t slot = b->state_slots[s];
        if (slot >= 0 && slot < pool->num_slots) c->slot_seen[slot] = 0;
    }
    return st;
}

/* Build and allocate the step's graph, or keep the last one when the shapes match. */
static int32_t step_graph(pp_context *c, const pp_batch *b, int gather, const step_shape *shape) {
    c->stats.reused = c->graph && same_shape(&c->graph_shape, shape);
    if (c->stats.reused) return PP_OK;
    forget_graph(c);
    struct ggml_init_params params = {.mem_size = c->meta_size, .mem_buffer = c->meta_buf, .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return pp_fail(PP_ERR_NO_MEMORY, "cannot create the graph context");
    pp_lora_plan_reset_inputs(c->lora_plan);
    const pp_recurrent_step rs = {.pool = c->state_pool, .plan = &c->delta_plan};
    struct ggml_cgraph *gf = pp_build_graph(ctx, c->model, c->cache, b, c->layer_params, c->gemm_states,
                                            c->n_threads, gather, c->max_nodes, c->model->n_recurrent ? &rs : NULL);
    if (shape->argmax) {   /* each row's greedy token, beside (or, read back, instead of) its logits */
        struct ggml_tensor *ids = ggml_argmax(ctx, ggml_graph_get_tensor(gf, "logits"));
        ggml_set_name(ids, "argmax");
        ggml_set_output(ids);
        ggml_build_forward_expand(gf, ids);
    }
    if (c->sched) ggml_backend_sched_reset(c->sched);
    if (!(c->sched ? ggml_backend_sched_alloc_graph(c->sched, gf) : ggml_gallocr_alloc_graph(c->galloc, gf))) {
        ggml_free(ctx);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the compute buffer for %d tokens", b->n_tokens);
    }
    c->graph_ctx = ctx;
    c->graph = gf;
    c->graph_shape = *shape;
    c->in_tokens = ggml_graph_get_tensor(gf, "tokens");
    c->in_positions = ggml_graph_get_tensor(gf, "positions");
    c->in_slots = ggml_graph_get_tensor(gf, "slots");
    c->in_rows = ggml_graph_get_tensor(gf, "logit_rows");
    c->in_mrope = ggml_graph_get_tensor(gf, "mrope_positions");
    c->in_state_slots = ggml_graph_get_tensor(gf, "state_slots");
    c->out_logits = ggml_graph_get_tensor(gf, "logits");
    c->out_argmax = ggml_graph_get_tensor(gf, "argmax");
    c->out_hidden = ggml_graph_get_tensor(gf, "hidden");
    c->stats.n_builds++;
    c->stats.n_nodes = ggml_graph_n_nodes(gf);
    c->stats.n_inputs = 0;
    c->stats.input_bytes = 0;
    for (struct ggml_tensor *t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (!(t->flags & GGML_TENSOR_FLAG_INPUT)) continue;
        c->stats.n_inputs++;
        c->stats.input_bytes += (int64_t)ggml_nbytes(t);
    }
    return PP_OK;
}

/* The step's logits (left in the compute buffer on the CPU, read back from
 * a device) and hidden rows. */
static int32_t read_outputs(pp_context *c, const pp_batch *b, float *logits) {
    const pp_model *m = c->model;
    struct ggml_tensor *ids = b->n_logits > 0 ? c->out_argmax : NULL;
    if (ids) {
        ggml_backend_tensor_get(ids, c->step_ids, 0, sizeof(int32_t) * b->n_logits);
        c->step_n_ids = b->n_logits;
    }
    if (b->n_logits > 0) {
        struct ggml_tensor *out = c->out_logits;
        const size_t floats = (size_t)b->n_logits * m->hp.n_vocab;
        if (ids && b->argmax_only && !logits && !ggml_backend_buffer_is_host(out->buffer)) {
            /* the ids are all the caller reads: the rows stay on the device */
        } else if (ggml_backend_buffer_is_host(out->buffer)) {
            /* the graph output stays in the allocator's buffer until the next step allocates:
             * with no logits buffer the caller reads it there (no copy of n_logits x n_vocab) */
            c->step_logits = out->data;
        } else {
            if (c->host_logits_floats < floats) {
                float *grown = realloc(c->host_logits, floats * sizeof(float));
                if (!grown) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate %zu logits", floats);
                c->host_logits = grown;
                c->host_logits_floats = floats;
            }
            ggml_backend_tensor_get(out, c->host_logits, 0, floats * sizeof(float));
            c->step_logits = c->host_logits;
        }
        if (c->step_logits) c->step_n_logits = b->n_logits;
        if (logits) memcpy(logits, c->step_logits, sizeof(float) * floats);
    }
    if (b->n_hidden > 0) {
        /* a view of the normed rows: read row by row (its stride is the parent's) */
        struct ggml_tensor *out = c->out_hidden;
        for (int i = 0; i < b->n_hidden; i++)
            ggml_backend_tensor_get(out, b->hidden + (size_t)i * m->hp.n_embd, (size_t)i * out->nb[1],
                                    sizeof(float) * m->hp.n_embd);
    }
    return PP_OK;
}

int32_t pp_context_decode(pp_context *c, const pp_batch *b, float *logits) {
    if (!c) return pp_fail(PP_ERR_INVALID, "pp_context_decode: context is NULL");
    /* whatever happens next, the last step's rows are no longer this context's answer
     * (and the compute buffer they live in is about to be reused) */
    c->step_logits = NULL;
    c->step_n_logits = 0;
    c->step_n_ids = 0;
    int st = pp_check_batch(c->model, c->cache, b);
    if (st != PP_OK) return st;
    if (b->n_tokens > c->max_batch_tokens)
        return pp_fail(PP_ERR_INVALID, "batch of %d tokens exceeds max_batch_tokens %d", b->n_tokens,
                       c->max_batch_tokens);
    if (c->model->n_recurrent > 0) {
        st = check_state_slots(c, b);
        if (st == PP_OK) st = pp_delta_plan_make(&c->delta_plan, b);
        if (st != PP_OK) return st;
    }
    st = pp_context_set_threads(c, c->n_threads);   /* a no-op unless this is a forked child */
    if (st != PP_OK) return st;
    const pp_model *m = c->model;
    int32_t n_lora = 0;
    st = pp_lora_plan_make(c->lora_plan, m, b, &n_lora);
    if (st != PP_OK) return st;
    /* A sequence starting at position 0 starts from zero states, whatever its slot held. */
    for (int t = 0; m->n_recurrent > 0 && t < b->n_tokens; t++)
        if ((t == 0 || b->seq_index[t] != b->seq_index[t - 1]) && b->positions[t] == 0)
            pp_state_pool_zero_slot(c->state_pool, b->state_slots[b->seq_index[t]]);
    int swa_window = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        c->layer_params[il].batch = b;
        c->layer_params[il].lora = n_lora > 0 ? c->lora_plan : NULL;
        atomic_store(&c->layer_params[il].slices_done, 0);
        if (m->layer_window[il] > swa_window) swa_window = m->layer_window[il];
    }
    const int gather = c->cache->paged && c->attention_path == PP_ATTENTION_GATHER;
    /* GGML's flash attention runs for slabs, the gather path, and the layers whose pools are on a device */
    const int flash = !c->cache->paged || gather || c->cache->device_buffer;
    if (flash && c->cache->paged) pp_flash_plan_make(&c->plan, b, swa_window);
    const step_shape shape = shape_of(c, b, gather, flash && c->cache->paged);
    st = step_graph(c, b, gather, &shape);
    if (st == PP_OK) st = upload_inputs(c, c->graph, b, flash, swa_window);
    if (st != PP_OK) {
        forget_graph(c);
        return st;
    }
    struct ggml_cgraph *gf = c->graph;
    if (c->gemm_states) pp_panel_gemm_rearm(c->gemm_states, m->n_panel_slots, c->n_threads);
    enum ggml_status status = c->sched ? ggml_backend_sched_graph_compute(c->sched, gf)
                                       : ggml_backend_graph_compute(c->backend, gf);
    atomic_store(&c->abort_requested, 0);   /* a request is consumed by the step it stopped */
    if (status != GGML_STATUS_SUCCESS) {
        forget_graph(c);
        return pp_fail(PP_ERR_COMPUTE, status == GGML_STATUS_ABORTED ? "step aborted on request"
                                                                     : "graph compute failed with GGML status %d",
                       (int)status);
    }
    c->stats.n_steps++;
    return read_outputs(c, b, logits);
}

struct ggml_cgraph *pp_context_last_graph(const pp_context *c) { return c ? c->graph : NULL; }

ggml_backend_sched_t pp_context_scheduler(const pp_context *c) { return c ? c->sched : NULL; }

int32_t pp_context_step_stats(const pp_context *c, pp_step_stats *out) {
    if (!c || !out) return pp_fail(PP_ERR_INVALID, "pp_context_step_stats: NULL argument");
    *out = c->stats;
    return PP_OK;
}

const int32_t *pp_context_step_argmax(const pp_context *c, int32_t *n_rows) {
    const int32_t n = c ? c->step_n_ids : 0;
    if (n_rows) *n_rows = n;
    return n > 0 ? c->step_ids : NULL;
}

const float *pp_context_step_logits(const pp_context *c, int32_t *n_rows) {
    if (n_rows) *n_rows = c ? c->step_n_logits : 0;
    return c ? c->step_logits : NULL;
}

int32_t pp_context_abort(pp_context *c) {
    if (!c) return pp_fail(PP_ERR_INVALID, "pp_context_abort: context is NULL");
    atomic_store(&c->abort_requested, 1);
    return PP_OK;
}

int32_t pp_context_reserve_loras(pp_context *c, int32_t max_loras) {
    if (!c) return pp_fail(PP_ERR_INVALID, "pp_context_reserve_loras: context is NULL");
    if (max_loras < 1 || max_loras > PP_LORA_MAX_PER_STEP)
        return pp_fail(PP_ERR_INVALID, "max_loras %d outside 1..%d", max_loras, PP_LORA_MAX_PER_STEP);
    if (pp_lora_plan_max_loras(c->lora_plan) >= max_loras) return PP_OK;
    const int n_layer = c->model->hp.n_layer;
    const size_t max_nodes = pp_graph_capacity(n_layer, c->max_batch_tokens) + pp_lora_graph_nodes(n_layer, max_loras);
    const size_t meta_size = ggml_tensor_overhead() * max_nodes + ggml_graph_overhead_custom(max_nodes, false);
    pp_lora_plan *plan = NULL;
    int32_t st = pp_lora_plan_create(max_loras, c->max_batch_tokens, &plan);
    if (st != PP_OK) return st;
    void *meta = malloc(meta_size);
    ggml_backend_sched_t sched = NULL;
    if (meta && c->sched) {   /* the scheduler's graph size is fixed when it is made */
        ggml_backend_t backends[2] = {c->device_backend, c->backend};
        sched = ggml_backend_sched_new(backends, NULL, 2, max_nodes, false, false);
    }
    if (!meta || (c->sched && !sched)) {
        free(meta);
        pp_lora_plan_destroy(plan);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot make room for steps of %d LoRA adapters", max_loras);
    }
    forget_graph(c);   /* it lives in the old metadata arena */
    free(c->meta_buf);
    c->meta_buf = meta;
    c->meta_size = meta_size;
    c->max_nodes = max_nodes;
    if (sched) {
        ggml_backend_sched_free(c->sched);
        c->sched = sched;
    }
    pp_lora_plan_destroy(c->lora_plan);
    c->lora_plan = plan;
    return PP_OK;
}

const char *pp_ggml_build_info(void) {
    static char info[256];
    /* llamafile = GGML's tinyBLAS GEMM for prompt processing (GGML_LLAMAFILE);
     * attention = our kernel's math variant on this CPU. */
    snprintf(info, sizeof info, "ggml %s; cpu: avx=%d avx2=%d f16c=%d fma=%d avx512=%d avx512_vnni=%d "
             "llamafile=%d; attention=%s", ggml_version(), ggml_cpu_has_avx(), ggml_cpu_has_avx2(),
             ggml_cpu_has_f16c(), ggml_cpu_has_fma(), ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni(),
             ggml_cpu_has_llamafile(), pp_attention_math_select()->name);
    return info;
}
