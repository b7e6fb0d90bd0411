/* Weight repacking. GGML's CPU backend offers "extra" buffer types whose
 * tensors are stored in the layout its GEMM kernels want (rows of several
 * output channels interleaved, e.g. Q4_K as 8x8 tiles for AVX2); the
 * layout is made when the bytes are uploaded. A tensor may only go there if
 * its every consumer is a ggml_mul_mat, so the token embedding (read by
 * ggml_get_rows) never does, even when the output head is tied to it. */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "panels/panels.h"
#include "ggml-cpu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* MADV_PAGEOUT keeps the contents (a file page faults back in from the
 * file, an anonymous one from swap), unlike MADV_DONTNEED, which would zero
 * a caller's anonymous memory. */
void pp_release_mapped(const void *data, size_t size) {
#ifdef MADV_PAGEOUT
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t begin = ((uintptr_t)data + page - 1) & ~(page - 1);
    const uintptr_t end = ((uintptr_t)data + size) & ~(page - 1);
    if (end > begin) madvise((void *)begin, end - begin, MADV_PAGEOUT);
#else
    (void)data;
    (void)size;
#endif
}

/* The weights whose only consumer in graph.c is ggml_mul_mat. */
static int matmul_weights(const pp_model *m, struct ggml_tensor **out) {
    int n = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int p = 0; p < PP_N_PROJ; p++) {
            struct ggml_tensor *w = pp_layer_weight(&m->layers[il], p);
            if (w && !(m->panels && m->panels[il * PP_N_PROJ + p]) && !pp_layer_on_device(m, il)) out[n++] = w;
        }
    }
    if (m->output && !(m->panels && m->panels[m->hp.n_layer * PP_N_PROJ]) && !pp_layer_on_device(m, m->hp.n_layer))
        out[n++] = m->output;
    return n;
}

/* Whether the CPU device would run a mul_mat with weight w held in a buffer
 * of probe's type: asked of a throwaway op whose weight copy points at the
 * zero-size probe buffer (the check reads only type, shape and buffer). */
static bool buffer_takes(ggml_backend_dev_t dev, ggml_backend_buffer_t probe, const struct ggml_tensor *w) {
    struct ggml_init_params params = {.mem_size = 4 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return false;
    struct ggml_tensor *wc = ggml_new_tensor_2d(ctx, w->type, w->ne[0], w->ne[1]);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 8);
    wc->buffer = probe;
    const bool ok = ggml_backend_dev_supports_op(dev, ggml_mul_mat(ctx, wc, x));
    ggml_free(ctx);
    return ok;
}

/* Allocate one buffer of buft for the tensors chosen for it and upload them
 * (the upload repacks). Returns the number moved or -1 (error recorded). */
static int move_into(pp_model *m, ggml_backend_buffer_type_t buft, struct ggml_tensor **w, const int *choice,
                     int n, int which) {
    const size_t align = ggml_backend_buft_get_alignment(buft);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (choice[i] == which) total += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, w[i]), align);
    if (total == 0) return 0;
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, total);
    if (!buf) {
        pp_fail(PP_ERR_NO_MEMORY, "cannot allocate %zu bytes of %s weight buffer", total,
                ggml_backend_buft_name(buft));
        return -1;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    m->repack_buffers[m->n_repack_buffers++] = buf;
    char *addr = ggml_backend_buffer_get_base(buf);
    int moved = 0;
    for (int i = 0; i < n; i++) {
        if (choice[i] != which) continue;
        void *mapped = w[i]->data;
        ggml_backend_buffer_t mapped_home = w[i]->buffer;   /* NULL, or the model's mapped_buffer */
        w[i]->data = NULL;
        w[i]->buffer = NULL;
        if (ggml_backend_tensor_alloc(buf, w[i], addr) != GGML_STATUS_SUCCESS) {
            w[i]->data = mapped;
            w[i]->buffer = mapped_home;
            pp_fail(PP_ERR_NO_MEMORY, "cannot place tensor '%s' in the %s buffer", w[i]->name,
                    ggml_backend_buft_name(buft));
            return -1;
        }
        ggml_backend_tensor_set(w[i], mapped, 0, ggml_nbytes(w[i]));
        pp_release_mapped(mapped, ggml_nbytes(w[i]));
        addr += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, w[i]), align);
        moved++;
    }
    return moved;
}

int32_t pp_model_repack_weights(pp_model *m, int32_t *n_repacked) {
    if (n_repacked) *n_repacked = 0;
    if (!m || !m->finalized) return pp_fail(PP_ERR_INVALID, "pp_model_repack_weights: model missing or not finalized");
    if (m->repack_done) return pp_fail(PP_ERR_INVALID, "the model's weights are already repacked");
    m->repack_done = 1;
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = reg ? ggml_backend_reg_dev_get(reg, 0) : NULL;
    ggml_backend_dev_get_extra_bufts_t get_extra = reg
        ? (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")
        : NULL;
    ggml_backend_buffer_type_t *bufts = get_extra && dev ? get_extra(dev) : NULL;
    if (!bufts || !bufts[0]) return PP_OK;

    const int max_weights = m->hp.n_layer * PP_N_PROJ + 1;
    struct ggml_tensor **w = malloc(sizeof *w * (size_t)max_weights);
    int *choice = malloc(sizeof *choice * (size_t)max_weights);
    if (!w || !choice) {
        free(w);
        free(choice);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the repack tables");
    }
    const int n = matmul_weights(m, w);
    for (int i = 0; i < n; i++) choice[i] = -1;
    int n_bufts = 0;
    while (n_bufts < PP_MAX_REPACK_BUFTS && bufts[n_bufts]) n_bufts++;
    /* The first extra type that takes a tensor gets it, as in GGML's own order,
     * except AMX: a GGML built natively on a Sapphire Rapids CPU lists it first,
     * and its mul_mat segfaults on the first step with our Q4_K_M weights (GGML's
     * AMX kernel, reported upstream as llama.cpp#20824 with no fix). The repack
     * type after it takes those tensors instead. */
    for (int b = 0; b < n_bufts; b++) {
        if (strcmp(ggml_backend_buft_name(bufts[b]), "AMX") == 0) continue;
        ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(bufts[b], 0);
        if (!probe) continue;
        for (int i = 0; i < n; i++)
            if (choice[i] < 0 && buffer_takes(dev, probe, w[i])) choice[i] = b;
        ggml_backend_buffer_free(probe);
    }
    int status = PP_OK, total = 0;
    for (int b = 0; b < n_bufts; b++) {
        const int moved = move_into(m, bufts[b], w, choice, n, b);
        if (moved < 0) {
            status = PP_ERR_NO_MEMORY;
            break;
        }
        total += moved;
    }
    if (n_repacked) *n_repacked = total;
    free(w);
    free(choice);
    return status;
}

/* Packing in chunks of panels on every CPU: the copy itself is quick, but
 * each new panel page is faulted in (and zeroed) by the thread that first
 * writes it, and 2 MiB pages fault slowly where the kernel compacts memory
 * for them: one thread took 8.8 s for a 4B Q4_K_M file. */
#define PACK_CHUNK_PANELS 256
#define PACK_MAX_THREADS 16

typedef struct pack_chunk {
    pp_q8_panels *panels;
    const void   *src;
    int64_t       p0, p1;
    size_t        row_bytes;   /* of the GGML rows */
} pack_chunk;

typedef struct pack_work {
    pack_chunk *chunks;
    int64_t     n_chunks;
    atomic_llong next;
} pack_work;

static void *pack_chunks(void *arg) {
    pack_work *work = arg;
    for (;;) {
        const int64_t i = atomic_fetch_add(&work->next, 1);
        if (i >= work->n_chunks) return NULL;
        const pack_chunk *c = &work->chunks[i];
        pp_q8_panels_pack_range(c->panels, c->src, c->p0, c->p1);
        /* From here on the graph reads the panels only (a tied head's embedding too): the
         * chunk's rows are released here, in parallel too (paging a file's pages out costs
         * as much as packing them). */
        pp_release_mapped((const uint8_t *)c->src + (size_t)c->p0 * PP_PANEL_ROWS * c->row_bytes,
                          (size_t)(c->p1 - c->p0) * PP_PANEL_ROWS * c->row_bytes);
    }
}

/* Every chunk packed, on up to one thread per online CPU (this one too). */
static void pack_in_parallel(pack_work *work) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int n_threads = cpus < 1 ? 1 : cpus > PACK_MAX_THREADS ? PACK_MAX_THREADS : (int)cpus;
    if (n_threads > work->n_chunks) n_threads = (int)(work->n_chunks > 0 ? work->n_chunks : 1);
    pthread_t threads[PACK_MAX_THREADS];
    int started[PACK_MAX_THREADS] = {0};
    for (int t = 1; t < n_threads; t++) started[t] = pthread_create(&threads[t], NULL, pack_chunks, work) == 0;
    pack_chunks(work);   /* a thread that could not start leaves its chunks to the others */
    for (int t = 1; t < n_threads; t++)
        if (started[t]) pthread_join(threads[t], NULL);
}

/* Layer L's expert tensor in panel slot proj (gate, or gemma4's gate and up in one; up; down), or NULL. */
static struct ggml_tensor *expert_weight(const pp_layer *L, int proj) {
    return proj == PP_PROJ_GATE ? (L->ffn_gate_up_exps ? L->ffn_gate_up_exps : L->ffn_gate_exps)
         : proj == PP_PROJ_UP ? L->ffn_up_exps : proj == PP_PROJ_DOWN ? L->ffn_down_exps : NULL;
}

int32_t pp_model_pack_panels(pp_model *m, int32_t any_cpu, int32_t *kernel, int32_t *n_packed) {
    if (kernel) *kernel = PP_PANEL_KERNEL_NONE;
    if (n_packed) *n_packed = 0;
    if (!m || !m->finalized) return pp_fail(PP_ERR_INVALID, "pp_model_pack_panels: model missing or not finalized");
    if (m->hp.arch == PP_ARCH_BERT) return PP_OK;   /* the encoder runs its own graph */
    if (m->panels) return pp_fail(PP_ERR_INVALID, "the model's weights are already packed into panels");
    if (m->repack_done)
        return pp_fail(PP_ERR_INVALID, "pack panels before pp_model_repack_weights (it moves weights away)");
    enum pp_panel_kernel chosen = pp_panel_kernel_select();
    /* The portable kernel is for tests (any_cpu): where no VNNI kernel runs, GGML's are faster. */
    if (chosen == PP_PANEL_KERNEL_SCALAR && !any_cpu) chosen = PP_PANEL_KERNEL_NONE;
    if (chosen == PP_PANEL_KERNEL_NONE && any_cpu) chosen = PP_PANEL_KERNEL_SCALAR;
    if (chosen == PP_PANEL_KERNEL_NONE) return PP_OK;
    const int n_slots = m->hp.n_layer * PP_N_PROJ + 1;
    pp_q8_panels **panels = calloc((size_t)n_slots, sizeof *panels);
    pp_expert_panels **experts = calloc((size_t)n_slots, sizeof *experts);
    struct ggml_tensor **weights = calloc((size_t)n_slots, sizeof *weights);
    struct ggml_tensor **expert_weights = calloc((size_t)n_slots, sizeof *expert_weights);
    if (!panels || !experts || !weights || !expert_weights) {
        free(panels);
        free(experts);
        free(weights);
        free(expert_weights);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the panel table");
    }
    /* Allocate every weight's panels first: on failure nothing is packed and the model is unchanged. */
    int64_t n_chunks = 0;
    int32_t status = PP_OK;
    for (int slot = 0; slot < n_slots && status == PP_OK; slot++) {
        struct ggml_tensor *w = slot < n_slots - 1 ? pp_layer_weight(&m->layers[slot / PP_N_PROJ], slot % PP_N_PROJ)
                                                   : (m->output ? m->output : m->tok_embd);
        /* a weight on a device runs GGML's product there */
        if (!w || pp_layer_on_device(m, slot / PP_N_PROJ) || !pp_q8_panels_fit(w->type, w->ne[0], w->ne[1], chosen))
            continue;
        panels[slot] = pp_q8_panels_alloc(w->type, w->ne[0], w->ne[1]);
        weights[slot] = w;
        if (!panels[slot])
            status = pp_fail(PP_ERR_NO_MEMORY, "cannot allocate %zu bytes for the panels of '%s'", ggml_nbytes(w),
                             w->name);
        else
            n_chunks += (w->ne[1] / PP_PANEL_ROWS + PACK_CHUNK_PANELS - 1) / PACK_CHUNK_PANELS;
    }
    for (int slot = 0; slot < n_slots - 1 && status == PP_OK; slot++) {
        struct ggml_tensor *w = expert_weight(&m->layers[slot / PP_N_PROJ], slot % PP_N_PROJ);
        /* as for the dense weights: what the panels do not take stays with ggml_mul_mat_id */
        if (!w || pp_layer_on_device(m, slot / PP_N_PROJ) || !pp_q8_panels_fit(w->type, w->ne[0], w->ne[1], chosen))
            continue;
        experts[slot] = pp_expert_panels_alloc(w->type, w->ne[0], w->ne[1], w->ne[2]);
        expert_weights[slot] = w;
        if (!experts[slot])
            status = pp_fail(PP_ERR_NO_MEMORY, "cannot allocate %zu bytes for the panels of '%s'", ggml_nbytes(w),
                             w->name);
        else
            n_chunks += w->ne[2] * ((w->ne[1] / PP_PANEL_ROWS + PACK_CHUNK_PANELS - 1) / PACK_CHUNK_PANELS);
    }
    pack_work work = {.chunks = status == PP_OK ? calloc((size_t)(n_chunks > 0 ? n_chunks : 1), sizeof(pack_chunk)) : NULL,
                      .n_chunks = n_chunks};
    if (status == PP_OK && !work.chunks) status = pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the packing work list");
    if (status != PP_OK) {
        for (int slot = 0; slot < n_slots; slot++) {
            pp_q8_panels_free(panels[slot]);
            pp_expert_panels_free(experts[slot]);
        }
        free(panels);
        free(experts);
        free(weights);
        free(expert_weights);
        return status;
    }
    int64_t c = 0;
    for (int slot = 0; slot < n_slots; slot++) {
        if (!panels[slot]) continue;
        const int64_t n_panels = panels[slot]->n_rows / PP_PANEL_ROWS;
        for (int64_t p0 = 0; p0 < n_panels; p0 += PACK_CHUNK_PANELS)
            work.chunks[c++] = (pack_chunk){panels[slot], weights[slot]->data, p0,
                                            p0 + PACK_CHUNK_PANELS < n_panels ? p0 + PACK_CHUNK_PANELS : n_panels,
                                            weights[slot]->nb[1]};
    }
    for (int slot = 0; slot < n_slots; slot++) {
        if (!experts[slot]) continue;
        const struct ggml_tensor *w = expert_weights[slot];
        const int64_t n_panels = w->ne[1] / PP_PANEL_ROWS;
        for (int64_t e = 0; e < w->ne[2]; e++)
            for (int64_t p0 = 0; p0 < n_panels; p0 += PACK_CHUNK_PANELS)
                work.chunks[c++] = (pack_chunk){&experts[slot]->experts[e], (const uint8_t *)w->data + e * w->nb[2], p0,
                                                p0 + PACK_CHUNK_PANELS < n_panels ? p0 + PACK_CHUNK_PANELS : n_panels,
                                                w->nb[1]};
    }
    atomic_init(&work.next, 0);
    pack_in_parallel(&work);
    free(work.chunks);
    int packed = 0, packed_experts = 0;
    for (int slot = 0; slot < n_slots; slot++) {
        packed += panels[slot] != NULL;
        packed_experts += experts[slot] != NULL;
    }
    m->panels = panels;
    m->n_panel_slots = n_slots;
    if (packed_experts) m->expert_panels = experts;
    else free(experts);
    packed += packed_experts;
    free(weights);
    free(expert_weights);
    if (kernel && packed) *kernel = chosen;
    if (n_packed) *n_packed = packed;
    return PP_OK;
}
