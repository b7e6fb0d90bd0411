/* A compute context of one's own on GGML's CPU backend, for the graphs that
 * run beside the decoder's steps (an encoder model's, a vision tower's): the
 * backend with a thread pool whose idle workers sleep, a graph allocator
 * reused across calls, and an arena for the graphs' metadata. */
#ifndef PP_CPU_COMPUTE_H
#define PP_CPU_COMPUTE_H

#include "common/pp_internal.h"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <sys/types.h>

typedef struct pp_cpu_compute {
    ggml_backend_t    backend;
    ggml_threadpool_t threadpool;
    pid_t             pool_pid;   /* a forked child must not join its parent's workers */
    ggml_gallocr_t    galloc;
    void             *meta_buf;   /* graph metadata arena, reused each call */
    size_t            meta_size;
} pp_cpu_compute;

/* Start c (zeroed by the caller) with n_threads workers and room for graphs
 * of n_nodes nodes. PP_ERR_NO_MEMORY (everything released again) if any part
 * cannot be had. */
PP_HIDDEN int32_t pp_cpu_compute_init(pp_cpu_compute *c, int n_threads, size_t n_nodes);

/* Free what c holds (any part may be missing). */
PP_HIDDEN void pp_cpu_compute_release(pp_cpu_compute *c);

/* A graph context on c's arena (free it with ggml_free). After fork() the
 * child first gets a backend without the parent's pool. NULL, with the error
 * set, if either cannot be had. */
PP_HIDDEN struct ggml_context *pp_cpu_compute_begin(pp_cpu_compute *c);

/* Allocate gf's tensors (before its inputs are written): PP_ERR_NO_MEMORY
 * naming what. */
PP_HIDDEN int32_t pp_cpu_compute_alloc(pp_cpu_compute *c, struct ggml_cgraph *gf, const char *what);

/* Compute gf: PP_ERR_COMPUTE naming what if GGML fails. */
PP_HIDDEN int32_t pp_cpu_compute_run(pp_cpu_compute *c, struct ggml_cgraph *gf, const char *what);

#endif
