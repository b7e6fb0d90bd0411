/* LoRA in a step's graph: the base product W x runs for every column as
 * always (panels, GGML's products), then each adapter the step runs adds
 * factor * scale * B (A x) to its own columns only. Sequences with different
 * adapters, and sequences with none, share the step.
 *
 * A step's columns are its tokens, or, after the last layer's attention,
 * the rows it keeps (logit rows, then hidden rows). The plan lists each set's
 * columns grouped by adapter (perm) with each column's user scale. An adapter
 * then gathers its columns of x (get_rows), runs its two small products on
 * them alone, and adds the result into its columns of y (get_rows, add,
 * set_rows in place): its cost follows its own tokens, not the step's, where
 * one masked product per adapter over every column would cost each adapter
 * the whole step (with r << d the gather's copies of x and y are what it
 * pays instead). A step whose columns all run one adapter needs no gather. */
#include "model/lora.h"
#include "common/pp_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The column sets: the step's tokens, and the rows the last layer keeps. */
enum { SET_TOKENS, SET_ROWS, N_SETS };

typedef struct lora_columns {
    int32_t  n;             /* columns of the products */
    int32_t  n_adapted;     /* of them under an adapter: perm's and scale's length */
    int32_t  identity;      /* every column under the one adapter, in order: no gather */
    int32_t  capacity;
    int32_t *seg_first;     /* [max_loras + 1]: each active adapter's first entry of perm */
    int32_t *perm;          /* [capacity] column ids grouped by adapter, in column order within */
    int64_t *perm64;        /* [capacity] the same as set_rows takes them */
    float   *scale;         /* [capacity] each entry's user scale */
    int32_t *slot;          /* [capacity] scratch: each column's active adapter, or -1 */
    struct ggml_tensor *t_perm, *t_perm64, *t_scale;   /* this graph's inputs (NULL until used) */
} lora_columns;

struct pp_lora_plan {
    int32_t         max_loras;
    int32_t         n_layer;
    int32_t         n_active;
    const pp_lora **active;       /* [max_loras] the adapters the step runs */
    int32_t        *slot_of;      /* [max_loras] a batch adapter's index -> its active slot, or -1 */
    lora_columns    cols[N_SETS];
    /* each adapter's gathered columns of the last x it read: q, k and v (gate and up) share one x */
    struct ggml_tensor **gather_x, **gather_out;   /* [max_loras] */
};

static void free_columns(lora_columns *c) {
    free(c->seg_first);
    free(c->perm);
    free(c->perm64);
    free(c->scale);
    free(c->slot);
}

void pp_lora_plan_destroy(pp_lora_plan *p) {
    if (!p) return;
    for (int s = 0; s < N_SETS; s++) free_columns(&p->cols[s]);
    free(p->active);
    free(p->slot_of);
    free(p->gather_x);
    free(p->gather_out);
    free(p);
}

int32_t pp_lora_plan_create(int32_t max_loras, int32_t max_tokens, pp_lora_plan **out) {
    if (!out || max_loras < 1 || max_loras > PP_LORA_MAX_PER_STEP || max_tokens < 1)
        return pp_fail(PP_ERR_INVALID, "LoRA plan: %d adapters (1 to %d) for %d tokens", max_loras,
                       PP_LORA_MAX_PER_STEP, max_tokens);
    *out = NULL;
    pp_lora_plan *p = calloc(1, sizeof *p);
    int ok = p != NULL;
    if (ok) {
        p->max_loras = max_loras;
        p->active = calloc((size_t)max_loras, sizeof *p->active);
        p->slot_of = calloc((size_t)max_loras, sizeof *p->slot_of);
        p->gather_x = calloc((size_t)max_loras, sizeof *p->gather_x);
        p->gather_out = calloc((size_t)max_loras, sizeof *p->gather_out);
        ok = p->active && p->slot_of && p->gather_x && p->gather_out;
        /* kept rows: logit rows and hidden rows, each at most one per token */
        for (int s = 0; ok && s < N_SETS; s++) {
            lora_columns *c = &p->cols[s];
            c->capacity = s == SET_TOKENS ? max_tokens : 2 * max_tokens;
            c->seg_first = calloc((size_t)max_loras + 1, sizeof *c->seg_first);
            c->perm = calloc((size_t)c->capacity, sizeof *c->perm);
            c->perm64 = calloc((size_t)c->capacity, sizeof *c->perm64);
            c->scale = calloc((size_t)c->capacity, sizeof *c->scale);
            c->slot = calloc((size_t)c->capacity, sizeof *c->slot);
            ok = c->seg_first && c->perm && c->perm64 && c->scale && c->slot;
        }
    }
    if (!ok) {
        pp_lora_plan_destroy(p);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a LoRA plan for %d tokens", max_tokens);
    }
    *out = p;
    return PP_OK;
}

int32_t pp_lora_plan_max_loras(const pp_lora_plan *p) { return p ? p->max_loras : 0; }

/* The batch's adapters checked; the used ones given active slots in batch order. */
static int32_t take_adapters(pp_lora_plan *p, const pp_model *m, const pp_batch *b) {
    if (b->n_loras > p->max_loras)
        return pp_fail(PP_ERR_INVALID, "a step of %d LoRA adapters, but the context holds %d "
                       "(pp_context_reserve_loras)", b->n_loras, p->max_loras);
    for (int i = 0; i < b->n_loras; i++) {
        const pp_lora *l = b->loras[i];
        if (!l || pp_lora_model(l) != m || !pp_lora_is_final(l))
            return pp_fail(PP_ERR_INVALID, "LoRA adapter %d of the step is NULL, unfinalized or made for "
                           "another model", i);
        p->slot_of[i] = -1;
    }
    for (int s = 0; s < b->n_seqs; s++) {
        const int32_t a = b->seq_lora[s];
        if (a < -1 || a >= b->n_loras)
            return pp_fail(PP_ERR_INVALID, "sequence %d: LoRA index %d outside [-1, %d)", s, a, b->n_loras);
        if (a >= 0 && !isfinite(b->seq_lora_scale[s]))
            return pp_fail(PP_ERR_INVALID, "sequence %d: LoRA scale %g is not finite", s,
                           (double)b->seq_lora_scale[s]);
    }
    p->n_active = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const int32_t a = b->seq_lora[s];
        if (a >= 0 && p->slot_of[a] < 0) p->slot_of[a] = p->n_active++;
    }
    /* the slots in batch order, whatever order the sequences named them in */
    int32_t next = 0;
    for (int i = 0; i < b->n_loras; i++)
        if (p->slot_of[i] >= 0) {
            p->slot_of[i] = next;
            p->active[next++] = b->loras[i];
        }
    return PP_OK;
}

/* The batch token column j of set s stands for. */
static int32_t column_token(const pp_batch *b, int s, int32_t j) {
    if (s == SET_TOKENS) return j;
    return j < b->n_logits ? b->logit_rows[j] : b->hidden_rows[j - b->n_logits];
}

/* Set s's columns grouped by adapter (a counting sort: column order kept within each). */
static int32_t fill_columns(pp_lora_plan *p, const pp_batch *b, int s) {
    lora_columns *c = &p->cols[s];
    c->n = s == SET_TOKENS ? b->n_tokens : b->n_logits + b->n_hidden;
    if (c->n > c->capacity)
        return pp_fail(PP_ERR_INVALID, "a step of %d columns, but the LoRA plan holds %d", c->n, c->capacity);
    memset(c->seg_first, 0, sizeof *c->seg_first * ((size_t)p->max_loras + 1));
    for (int32_t j = 0; j < c->n; j++) {
        const int32_t a = b->seq_lora[b->seq_index[column_token(b, s, j)]];
        c->slot[j] = a >= 0 ? p->slot_of[a] : -1;
        if (c->slot[j] >= 0) c->seg_first[c->slot[j] + 1]++;
    }
    for (int k = 0; k < p->n_active; k++) c->seg_first[k + 1] += c->seg_first[k];
    c->n_adapted = c->seg_first[p->n_active];
    int used = 0;
    for (int k = 0; k < p->n_active; k++) used += c->seg_first[k + 1] > c->seg_first[k];
    c->identity = used == 1 && c->n_adapted == c->n;
    int32_t fill[PP_LORA_MAX_PER_STEP];
    memcpy(fill, c->seg_first, sizeof(int32_t) * (size_t)p->n_active);
    for (int32_t j = 0; j < c->n; j++) {
        if (c->slot[j] < 0) continue;
        const int32_t at = fill[c->slot[j]]++;
        c->perm[at] = j;
        c->perm64[at] = j;
        c->scale[at] = b->seq_lora_scale[b->seq_index[column_token(b, s, j)]];
    }
    return PP_OK;
}

int32_t pp_lora_plan_make(pp_lora_plan *p, const pp_model *m, const pp_batch *b, int32_t *n_active) {
    *n_active = 0;
    if (p) p->n_active = 0;
    if (b->n_loras == 0) return PP_OK;
    if (b->n_loras < 0 || !b->loras || !b->seq_lora || !b->seq_lora_scale)
        return pp_fail(PP_ERR_INVALID, "malformed batch: %d LoRA adapters without their arrays", b->n_loras);
    if (!p) return pp_fail(PP_ERR_INVALID, "a step with LoRA adapters on a context that reserved none "
                           "(pp_context_reserve_loras)");
    int32_t st = take_adapters(p, m, b);
    for (int s = 0; st == PP_OK && s < N_SETS; s++) st = fill_columns(p, b, s);
    if (st != PP_OK) {
        p->n_active = 0;
        return st;
    }
    p->n_layer = m->hp.n_layer;
    *n_active = p->n_active;
    return PP_OK;
}

static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }

uint64_t pp_lora_plan_shape(const pp_lora_plan *p) {
    if (!p || p->n_active == 0) return 0;
    uint64_t h = mix(14695981039346656037ull, (uint64_t)p->n_active);
    for (int k = 0; k < p->n_active; k++) h = mix(h, pp_lora_uid(p->active[k]));
    for (int s = 0; s < N_SETS; s++) {
        const lora_columns *c = &p->cols[s];
        h = mix(mix(h, (uint64_t)c->n), (uint64_t)c->identity);
        for (int k = 0; k <= p->n_active; k++) h = mix(h, (uint64_t)c->seg_first[k]);
    }
    return h ? h : 1;
}

void pp_lora_plan_reset_inputs(pp_lora_plan *p) {
    if (!p) return;
    for (int s = 0; s < N_SETS; s++) p->cols[s].t_perm = p->cols[s].t_perm64 = p->cols[s].t_scale = NULL;
    memset(p->gather_x, 0, sizeof *p->gather_x * (size_t)p->max_loras);
    memset(p->gather_out, 0, sizeof *p->gather_out * (size_t)p->max_loras);
}

void pp_lora_plan_upload(const pp_lora_plan *p) {
    if (!p || p->n_active == 0) return;
    for (int s = 0; s < N_SETS; s++) {
        const lora_columns *c = &p->cols[s];
        if (c->t_scale) ggml_backend_tensor_set(c->t_scale, c->scale, 0, sizeof(float) * (size_t)c->n_adapted);
        if (c->t_perm) ggml_backend_tensor_set(c->t_perm, c->perm, 0, sizeof(int32_t) * (size_t)c->n_adapted);
        if (c->t_perm64) ggml_backend_tensor_set(c->t_perm64, c->perm64, 0, sizeof(int64_t) * (size_t)c->n_adapted);
    }
}

/* The set's inputs, made with the graph's first adapted product over it. */
static void make_inputs(struct ggml_context *ctx, lora_columns *c, int s) {
    if (c->t_scale) return;
    char name[32];
    snprintf(name, sizeof name, "lora_scale%d", s);
    c->t_scale = pp_graph_input(ctx, GGML_TYPE_F32, c->n_adapted, name);
    if (c->identity) return;
    snprintf(name, sizeof name, "lora_perm%d", s);
    c->t_perm = pp_graph_input(ctx, GGML_TYPE_I32, c->n_adapted, name);
    snprintf(name, sizeof name, "lora_perm64_%d", s);
    c->t_perm64 = pp_graph_input(ctx, GGML_TYPE_I64, c->n_adapted, name);
}

static struct ggml_tensor *span(struct ggml_context *ctx, struct ggml_tensor *t, int32_t first, int32_t n) {
    return ggml_view_1d(ctx, t, n, (size_t)first * t->nb[0]);
}

/* factor * scale * B (A x) over columns xk, each with its scale (sk: [n]). */
static struct ggml_tensor *delta(struct ggml_context *ctx, const pp_lora_pair *pair, struct ggml_tensor *xk,
                                 struct ggml_tensor *sk) {
    struct ggml_tensor *t = pp_matmul(ctx, pair->a, xk);   /* [rank, n] */
    t = ggml_mul(ctx, t, ggml_reshape_2d(ctx, sk, 1, sk->ne[0]));
    if (pair->factor != 1.0f) t = ggml_scale(ctx, t, pair->factor);
    return pp_matmul(ctx, pair->b, t);                       /* [out, n] */
}

struct ggml_tensor *pp_lora_project(struct ggml_context *ctx, pp_lora_plan *p, int il, int proj,
                                    struct ggml_tensor *x, struct ggml_tensor *y) {
    if (!p || p->n_active == 0) return y;
    const int s = il == p->n_layer - 1 && proj >= PP_PROJ_O ? SET_ROWS : SET_TOKENS;
    lora_columns *c = &p->cols[s];
    GGML_ASSERT(x->ne[1] == c->n && "a projection's columns are the step's tokens or its kept rows");
    if (c->n_adapted == 0) return y;
    for (int k = 0; k < p->n_active; k++) {
        const pp_lora_pair *pair = pp_lora_pair_of(p->active[k], il, proj);
        const int32_t first = c->seg_first[k], n = c->seg_first[k + 1] - first;
        if (!pair || n == 0) continue;
        make_inputs(ctx, c, s);
        struct ggml_tensor *sk = span(ctx, c->t_scale, first, n);
        if (c->identity) return ggml_add(ctx, y, delta(ctx, pair, x, sk));
        if (p->gather_x[k] != x) {
            p->gather_x[k] = x;
            p->gather_out[k] = ggml_get_rows(ctx, x, span(ctx, c->t_perm, first, n));
        }
        struct ggml_tensor *ids = span(ctx, c->t_perm64, first, n);
        struct ggml_tensor *yk = ggml_add(ctx, ggml_get_rows(ctx, y, span(ctx, c->t_perm, first, n)),
                                          delta(ctx, pair, p->gather_out[k], sk));
        y = ggml_set_rows(ctx, y, yk, ids);
    }
    return y;
}

int pp_lora_touches_gated(const pp_lora_plan *p, int il) {
    if (!p || p->n_active == 0) return 0;
    for (int k = 0; k < p->n_active; k++)
        if (pp_lora_pair_of(p->active[k], il, PP_PROJ_GATE) || pp_lora_pair_of(p->active[k], il, PP_PROJ_UP))
            return 1;
    return 0;
}

/* Tensors one adapted product adds at most: the spans of perm, perm64 and
 * scale, the gather of x, A's and B's products (a padded product is three:
 * pad, product, view), the scale's reshape, mul and factor, the gather of y,
 * the add and the set_rows. */
#define NODES_PER_PRODUCT 18
#define NODES_PER_STEP 16   /* the inputs and what GGML adds around them */

size_t pp_lora_graph_nodes(int n_layer, int max_loras) {
    return NODES_PER_STEP + (size_t)n_layer * PP_N_PROJ * (size_t)max_loras * NODES_PER_PRODUCT;
}
