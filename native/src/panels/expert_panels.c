/* The routed experts' matrix products through the panel GEMM (panels.h:
 * pp_expert_matmul). A step's tokens each pick n_used experts; the (token,
 * slot) pairs are grouped by expert, each pair's activation column is
 * quantized once into its expert's run of columns, and every expert that was
 * picked runs its panels over its run, so its weights are read once per step
 * whatever the number of tokens routed to it. Three ops per layer and input:
 *
 *   grouping  selected ids I32 [n_used, n_tokens] -> the pairs by expert
 *             (one thread: a counting sort of a few thousand ids at most);
 *   columns   x f32 [k, 1 or n_used, n_tokens] -> [column bytes, n_pairs],
 *             the pairs' columns in grouped order, quantized as the dense
 *             GEMM's quantize op does (float panels: the f32 columns);
 *   gemm      -> [n_rows, n_used, n_tokens] f32, ggml_mul_mat_id's layout:
 *             the threads take (expert, chunk of panels) items from the
 *             state's counter, run the format's kernel into a scratch tile
 *             and copy each column's rows to its pair's place.
 *
 * The grouping is shared by the layer's three products and the columns by
 * gate and up (the same x). */
#include "panels/panel_formats.h"

#include <string.h>

/* Most panels an item covers, and most columns one kernel call takes: the
 * scratch tile of a thread is 32 x 8 rows by 64 columns of f32 (64 KiB). An
 * expert with more columns (a long prompt) runs its chunk once per 64. */
#define EXPERT_CHUNK_PANELS 32
#define EXPERT_TILE_COLUMNS 64

static _Thread_local _Alignas(64) float expert_tile[EXPERT_CHUNK_PANELS * PP_PANEL_ROWS * EXPERT_TILE_COLUMNS];

/* The grouping op's I32 output: n_expert, n_pairs, n_active, then
 * active[n_expert] (the experts picked, first n_active valid), offset[n_expert
 * + 1] (expert e's run in grouped order: [offset[e], offset[e + 1])),
 * cursor[n_expert] (the sort's scratch), pair_at[n_pairs] (the pair, token *
 * n_used + slot, at each grouped position) and pos_of[n_pairs] (its inverse). */
#define GROUPING_HEADER 3
typedef struct grouping {
    int32_t  n_expert, n_pairs, n_active;
    int32_t *active, *offset, *cursor, *pair_at, *pos_of;
} grouping;

static int64_t grouping_length(int64_t n_expert, int64_t n_pairs) {
    return GROUPING_HEADER + 3 * n_expert + 1 + 2 * n_pairs;
}

static grouping grouping_of(const struct ggml_tensor *t) {
    int32_t *g = t->data;
    grouping out = {.n_expert = g[0], .n_pairs = g[1], .n_active = g[2]};
    out.active = g + GROUPING_HEADER;
    out.offset = out.active + out.n_expert;
    out.cursor = out.offset + out.n_expert + 1;
    out.pair_at = out.cursor + out.n_expert;
    out.pos_of = out.pair_at + out.n_pairs;
    return out;
}

static void grouping_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    if (ith != 0) return;
    const struct ggml_tensor *ids = dst->src[0];
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    int32_t *head = dst->data;
    head[0] = (int32_t)(intptr_t)userdata;
    head[1] = (int32_t)(n_used * n_tokens);
    head[2] = 0;
    grouping g = grouping_of(dst);
    memset(g.offset, 0, sizeof(int32_t) * (size_t)(g.n_expert + 1));
    /* ids come from the graph's own top-k over n_expert probabilities */
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t i = 0; i < n_used; i++) {
            const int32_t e = *(const int32_t *)((const char *)ids->data + t * ids->nb[1] + i * ids->nb[0]);
            GGML_ASSERT(e >= 0 && e < g.n_expert);
            g.offset[e + 1]++;
        }
    for (int32_t e = 0; e < g.n_expert; e++) {
        if (g.offset[e + 1] > 0) g.active[head[2]++] = e;
        g.offset[e + 1] += g.offset[e];
        g.cursor[e] = g.offset[e];
    }
    for (int64_t t = 0; t < n_tokens; t++)
        for (int64_t i = 0; i < n_used; i++) {
            const int32_t e = *(const int32_t *)((const char *)ids->data + t * ids->nb[1] + i * ids->nb[0]);
            const int32_t pair = (int32_t)(t * n_used + i), pos = g.cursor[e]++;
            g.pair_at[pos] = pair;
            g.pos_of[pair] = pos;
        }
}

/* Each thread takes every nth token (x shared by a token's slots: quantized
 * once, then copied to its other slots' places) or every nth pair. */
static void columns_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *x = dst->src[0];
    const grouping g = grouping_of(dst->src[1]);
    const int64_t k = x->ne[0], n_tokens = x->ne[2], n_used = g.n_pairs / n_tokens;
    const size_t col_bytes = dst->nb[1];
    const int is_float = dst->type == GGML_TYPE_F32;
    const pp_panel_quantize_fn quantize = pp_panel_quantizer_for((enum pp_panel_kernel)(intptr_t)userdata);
    uint8_t *out = dst->data;
    const int shared = x->ne[1] == 1;
    const int64_t n_items = shared ? n_tokens : g.n_pairs;
    for (int64_t j = ith; j < n_items; j += nth) {
        const int64_t t = shared ? j : j / n_used, slot = shared ? 0 : j % n_used;
        const float *src = (const float *)((const char *)x->data + t * x->nb[2] + slot * x->nb[1]);
        uint8_t *col = out + (size_t)g.pos_of[shared ? t * n_used : j] * col_bytes;
        if (is_float) memcpy(col, src, (size_t)k * sizeof(float));
        else quantize(src, k, col);
        for (int64_t i = 1; shared && i < n_used; i++)
            memcpy(out + (size_t)g.pos_of[t * n_used + i] * col_bytes, col, col_bytes);
    }
}

/* Items are (active expert, chunk of its panels), expert by expert; a chunk
 * is about an eighth of a thread's share of the step's panels, at most
 * EXPERT_CHUNK_PANELS. The kernel runs on a copy of the expert's panels
 * header that starts at the chunk (kernels address panels from data by
 * index, never by n_rows), so its rows land at the top of the tile. */
static void gemm_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    pp_panel_gemm_state *st = userdata;
    const struct ggml_tensor *cols = dst->src[0];
    const grouping g = grouping_of(dst->src[1]);
    const pp_expert_panels *ep = st->experts;
    const pp_panel_kernel_fn fn = pp_panel_kernel_for(st->kernel, ep->experts[0].type);
    const int64_t n_rows = ep->experts[0].n_rows, n_panels = n_rows / PP_PANEL_ROWS;
    int64_t chunk = (int64_t)g.n_active * n_panels / (8 * (int64_t)nth);
    chunk = chunk < 1 ? 1 : chunk > EXPERT_CHUNK_PANELS ? EXPERT_CHUNK_PANELS : chunk;
    const int64_t per_expert = (n_panels + chunk - 1) / chunk, n_items = (int64_t)g.n_active * per_expert;
    float *out = dst->data;
    for (;;) {
        const int64_t item = atomic_fetch_add(&st->next_chunk, 1);
        if (item >= n_items) break;
        const int32_t e = g.active[item / per_expert];
        const int64_t p0 = item % per_expert * chunk, p1 = p0 + chunk < n_panels ? p0 + chunk : n_panels;
        const int64_t rows = (p1 - p0) * PP_PANEL_ROWS;
        pp_q8_panels part = ep->experts[e];
        part.data += (size_t)p0 * ep->panel_bytes;
        part.n_rows = rows;
        for (int64_t c0 = g.offset[e]; c0 < g.offset[e + 1]; c0 += EXPERT_TILE_COLUMNS) {
            const int64_t n = g.offset[e + 1] - c0 < EXPERT_TILE_COLUMNS ? g.offset[e + 1] - c0 : EXPERT_TILE_COLUMNS;
            fn(&part, 0, p1 - p0, (const uint8_t *)cols->data + (size_t)c0 * cols->nb[1], cols->nb[1], n, expert_tile,
               (size_t)rows);
            for (int64_t c = 0; c < n; c++)
                memcpy(out + (size_t)g.pair_at[c0 + c] * (size_t)n_rows + (size_t)p0 * PP_PANEL_ROWS,
                       expert_tile + (size_t)c * (size_t)rows, (size_t)rows * sizeof(float));
        }
    }
}

struct ggml_tensor *pp_expert_matmul(struct ggml_context *ctx, pp_expert_route *route, struct ggml_tensor *w,
                                     pp_panel_gemm_state *state, struct ggml_tensor *x) {
    struct ggml_tensor *selected = route->selected;
    if (!state || !state->experts) return ggml_mul_mat_id(ctx, w, x, selected);
    const pp_expert_panels *ep = state->experts;
    const int64_t k = ep->experts[0].k, n_rows = ep->experts[0].n_rows;
    const int64_t n_used = selected->ne[0], n_tokens = selected->ne[1];
    GGML_ASSERT(w->ne[0] == k && w->ne[1] == n_rows && w->ne[2] == ep->n_expert);
    GGML_ASSERT(selected->type == GGML_TYPE_I32 && x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) &&
                x->ne[0] == k && (x->ne[1] == 1 || x->ne[1] == n_used) && x->ne[2] == n_tokens && x->ne[3] == 1);
    if (!route->grouping)
        route->grouping = ggml_custom_4d(ctx, GGML_TYPE_I32, grouping_length(ep->n_expert, n_used * n_tokens), 1, 1,
                                         1, &selected, 1, grouping_op, 1, (void *)(intptr_t)ep->n_expert);
    const int is_float = pp_panel_type_is_float(ep->experts[0].type);
    const enum ggml_type col_type = is_float ? GGML_TYPE_F32 : GGML_TYPE_I8;
    if (route->x != x || !route->cols || route->cols->type != col_type) {
        struct ggml_tensor *args[2] = {x, route->grouping};
        route->cols = ggml_custom_4d(ctx, col_type, is_float ? k : (int64_t)pp_panel_column_bytes(k),
                                     n_used * n_tokens, 1, 1, args, 2, columns_op, GGML_N_TASKS_MAX,
                                     (void *)(intptr_t)state->kernel);
        route->x = x;
    }
    struct ggml_tensor *args[2] = {route->cols, route->grouping};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, n_rows, n_used, n_tokens, 1, args, 2, gemm_op, GGML_N_TASKS_MAX,
                          state);
}
