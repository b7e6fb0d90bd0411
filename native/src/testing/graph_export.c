/* A context's last step graph node by node, as GGML 0.20.2's CUDA backend
 * sees it when it decides whether a captured CUDA graph can be replayed
 * (pyllama_paged/testing/cuda_graph_replay.py applies that rule). */
#include "common/engine_internal.h"
#include "common/pp_internal.h"
#include "pyllama_paged_testing.h"

#include <stdio.h>
#include <string.h>

_Static_assert(GGML_MAX_SRC == 10, "pp_graph_node holds 10 sources");
_Static_assert(GGML_MAX_NAME == 64, "pp_graph_node holds 64-byte names");
_Static_assert(GGML_MAX_OP_PARAMS == 16 * sizeof(int32_t), "pp_graph_node holds 16 op parameters");

static uint64_t fnv1a(uint64_t h, const void *bytes, size_t n) {
    const unsigned char *p = bytes;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void export_node(const struct ggml_tensor *t, ggml_backend_sched_t sched, pp_graph_node *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->op, sizeof out->op, "%s", ggml_op_desc(t));
    memcpy(out->name, t->name, sizeof out->name);
    out->name[sizeof out->name - 1] = '\0';
    out->type = (int32_t)t->type;
    out->flags = t->flags;
    for (int d = 0; d < 4; d++) {
        out->ne[d] = t->ne[d];
        out->nb[d] = (uint64_t)t->nb[d];
    }
    memcpy(out->op_params, t->op_params, sizeof out->op_params);
    out->self = (uint64_t)(uintptr_t)t;
    out->data = (uint64_t)(uintptr_t)t->data;
    out->buffer = (uint64_t)(uintptr_t)t->buffer;
    out->view_src = (uint64_t)(uintptr_t)t->view_src;
    out->view_offs = (uint64_t)t->view_offs;
    out->extra = (uint64_t)(uintptr_t)t->extra;
    /* the rule memcmp()s the whole struct, padding included, then each source's properties */
    uint64_t h = fnv1a(1469598103934665603ull, t, sizeof *t);
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        const struct ggml_tensor *s = t->src[j];
        if (s) {
            out->src[j] = (uint64_t)(uintptr_t)s;
            out->src_data[j] = (uint64_t)(uintptr_t)s->data;
            for (int d = 0; d < 4; d++) {
                out->src_ne[j][d] = s->ne[d];
                out->src_nb[j][d] = (uint64_t)s->nb[d];
            }
        }
        h = fnv1a(h, &out->src_data[j], sizeof out->src_data[j]);
        h = fnv1a(h, out->src_ne[j], sizeof out->src_ne[j]);
        h = fnv1a(h, out->src_nb[j], sizeof out->src_nb[j]);
    }
    out->props_hash = h;
    ggml_backend_t backend = sched ? ggml_backend_sched_get_tensor_backend(sched, (struct ggml_tensor *)t) : NULL;
    out->backend = -1;
    for (int b = 0; sched && backend && b < ggml_backend_sched_get_n_backends(sched); b++)
        if (ggml_backend_sched_get_backend(sched, b) == backend) out->backend = b;
    out->on_host = !t->buffer || ggml_backend_buffer_is_host(t->buffer);
}

int32_t pp_context_graph_nodes(const pp_context *ctx, pp_graph_node *out, int32_t capacity, int32_t *n_nodes) {
    if (!ctx || !out || !n_nodes || capacity < 0)
        return pp_fail(PP_ERR_INVALID, "pp_context_graph_nodes: NULL argument or negative capacity");
    struct ggml_cgraph *gf = pp_context_last_graph(ctx);
    if (!gf) return pp_fail(PP_ERR_INVALID, "the context has no step graph (no step yet, or the last one failed)");
    const int n = ggml_graph_n_nodes(gf);
    *n_nodes = n;
    ggml_backend_sched_t sched = pp_context_scheduler(ctx);
    for (int i = 0; i < n && i < capacity; i++) export_node(ggml_graph_node(gf, i), sched, &out[i]);
    return PP_OK;
}
