/* A CPU compute context of one's own (cpu_compute.h). */
#include "common/cpu_compute.h"
#include "pyllama_paged.h"
#include "ggml-cpu.h"

#include <stdlib.h>
#include <unistd.h>

int32_t pp_cpu_compute_init(pp_cpu_compute *c, int n_threads, size_t n_nodes) {
    c->meta_size = ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false);
    c->meta_buf = malloc(c->meta_size);
    c->backend = ggml_backend_cpu_init();
    c->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    tpp.poll = 0;   /* idle workers sleep: between calls the CPU belongs to others */
    c->threadpool = ggml_threadpool_new(&tpp);
    c->pool_pid = getpid();
    if (!c->meta_buf || !c->backend || !c->galloc || !c->threadpool) {
        pp_cpu_compute_release(c);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot set up a CPU compute context");
    }
    ggml_backend_cpu_set_n_threads(c->backend, n_threads);
    ggml_backend_cpu_set_threadpool(c->backend, c->threadpool);
    return PP_OK;
}

void pp_cpu_compute_release(pp_cpu_compute *c) {
    if (c->galloc) ggml_gallocr_free(c->galloc);
    if (c->backend) ggml_backend_free(c->backend);
    if (c->threadpool && c->pool_pid == getpid()) ggml_threadpool_free(c->threadpool);
    free(c->meta_buf);
    *c = (pp_cpu_compute){0};
}

struct ggml_context *pp_cpu_compute_begin(pp_cpu_compute *c) {
    if (c->threadpool && c->pool_pid != getpid()) {
        /* after fork(): the parent's workers do not exist here; run without a pool */
        ggml_backend_t backend = ggml_backend_cpu_init();
        if (!backend) {
            pp_fail(PP_ERR_NO_MEMORY, "cannot set up the compute backend after fork");
            return NULL;
        }
        ggml_backend_free(c->backend);
        c->backend = backend;
        c->threadpool = NULL;
    }
    struct ggml_init_params params = {.mem_size = c->meta_size, .mem_buffer = c->meta_buf, .no_alloc = true};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) pp_fail(PP_ERR_NO_MEMORY, "cannot create a graph context");
    return ctx;
}

int32_t pp_cpu_compute_alloc(pp_cpu_compute *c, struct ggml_cgraph *gf, const char *what) {
    if (!ggml_gallocr_alloc_graph(c->galloc, gf))
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the compute buffer for %s", what);
    return PP_OK;
}

int32_t pp_cpu_compute_run(pp_cpu_compute *c, struct ggml_cgraph *gf, const char *what) {
    enum ggml_status status = ggml_backend_graph_compute(c->backend, gf);
    if (status != GGML_STATUS_SUCCESS)
        return pp_fail(PP_ERR_COMPUTE, "%s: graph compute failed with GGML status %d", what, (int)status);
    return PP_OK;
}
