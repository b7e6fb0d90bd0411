/* The batched sampler: every row a step samples, in one call, from the
 * logits the step left in memory. Greedy, temperature, top-k, top-p, min-p,
 * repetition/presence/frequency penalties, an optional token mask, a seeded
 * generator per sequence, and log-probabilities only for rows that ask.
 *
 * The vocabulary is never sorted and never copied. A row is a megabyte that
 * is not in cache, so each step of a row is one vectorized read of it
 * (sampling_math.c): the argmax; the whole row's mass (top-p is measured
 * against it) fused with the selection of the tokens above a probability
 * threshold; top-k from the tokens within a logit margin of the best. Only
 * those few candidates are weighed one by one and sorted. If the candidates
 * do not yet hold the nucleus, the threshold is lowered and the row read
 * again (every token left out is less likely than every token kept, so the
 * result is exact). Temperature alone draws by cumulative mass from partial
 * sums of the same pass. */
#include "pp_internal.h"
#include "sampling_math.h"
#include "pyllama_paged.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* One thread's working memory. */
typedef struct sampler_scratch {
    int32_t *history;    /* a row's history, sorted for counting; grown on demand */
    int32_t  history_capacity;
    float   *row;        /* [n_vocab] the row after penalties and mask */
    float   *weights;    /* [n_vocab] exp((logit - max) / temperature), set for candidates only */
    int32_t *cand;       /* [n_vocab] candidate ids, best first */
    int32_t *selected;   /* [n_vocab] ids a selection pass found, in id order */
    float   *block_sums; /* [n_vocab / PP_SUM_BLOCK + 1] partial masses of a row */
    float   *block_refs; /* [n_vocab / PP_SUM_BLOCK + 1] the scan's scratch */
} sampler_scratch;

struct pp_sampler {
    int32_t  n_vocab;
    int32_t  n_threads;
    sampler_scratch *scratch;        /* one per thread */
    const pp_sampling_math *math;    /* the vectorized passes over a row */
};

int pp_sampler_create(int32_t n_vocab, int32_t n_threads, pp_sampler **out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_sampler_create: out is NULL");
    *out = NULL;
    if (n_vocab < 1) return pp_fail(PP_ERR_INVALID, "n_vocab must be >= 1, got %d", n_vocab);
    if (n_threads < 1 || n_threads > 64) return pp_fail(PP_ERR_INVALID, "n_threads must be in [1, 64], got %d", n_threads);
    pp_sampler *s = calloc(1, sizeof *s);
    int ok = s != NULL;
    if (ok) {
        s->n_vocab = n_vocab;
        s->n_threads = n_threads;
        s->math = pp_sampling_math_select();
        s->scratch = calloc((size_t)n_threads, sizeof *s->scratch);
        ok = s->scratch != NULL;
        for (int32_t t = 0; ok && t < n_threads; t++) {
            sampler_scratch *sc = &s->scratch[t];
            sc->row = malloc(sizeof(float) * (size_t)n_vocab);
            sc->weights = malloc(sizeof(float) * (size_t)n_vocab);
            sc->cand = malloc(sizeof(int32_t) * (size_t)n_vocab);
            sc->selected = malloc(sizeof(int32_t) * (size_t)n_vocab);
            sc->block_sums = malloc(sizeof(float) * ((size_t)n_vocab / PP_SUM_BLOCK + 1));
            sc->block_refs = malloc(sizeof(float) * ((size_t)n_vocab / PP_SUM_BLOCK + 1));
            ok = sc->row && sc->weights && sc->cand && sc->selected && sc->block_sums && sc->block_refs;
        }
    }
    if (!ok) {
        pp_sampler_destroy(s);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a sampler for %d tokens", n_vocab);
    }
    *out = s;
    return PP_OK;
}

void pp_sampler_destroy(pp_sampler *s) {
    if (!s) return;
    for (int32_t t = 0; s->scratch && t < s->n_threads; t++) {
        free(s->scratch[t].history);
        free(s->scratch[t].row);
        free(s->scratch[t].weights);
        free(s->scratch[t].cand);
        free(s->scratch[t].selected);
        free(s->scratch[t].block_sums);
        free(s->scratch[t].block_refs);
    }
    free(s->scratch);
    free(s);
}

/* ---- the per-sequence generator: splitmix64 ------------------------------ */

uint64_t pp_sampler_seed(uint64_t seed) {
    /* One mixing step, so seeds 0, 1, 2 ... start far apart. */
    uint64_t z = seed + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double next_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);   /* [0, 1) with 53 bits */
}

/* ---- helpers ------------------------------------------------------------- */

static int cmp_int32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Sort ids by value, highest first (ties: lower id first, so results do not
 * depend on the order candidates were found in). */
static _Thread_local const float *sort_values;
static int cmp_by_value_desc(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (sort_values[x] != sort_values[y]) return sort_values[x] < sort_values[y] ? 1 : -1;
    return (x > y) - (x < y);
}

static void sort_desc(int32_t *ids, int32_t n, const float *values) {
    sort_values = values;
    qsort(ids, (size_t)n, sizeof *ids, cmp_by_value_desc);
}

/* The k highest of x over the n indices in from (all of 0..n-1 if from is
 * NULL; k <= n) into ids, highest first: a min-heap of k. */
static void top_k_ids(const float *x, const int32_t *from, int32_t n, int32_t k, int32_t *ids) {
    int32_t size = 0;
    for (int32_t f = 0; f < n; f++) {
        const int32_t i = from ? from[f] : f;
        if (size == k) {
            const int32_t root = ids[0];
            if (x[i] < x[root] || (x[i] == x[root] && i > root)) continue;
            ids[0] = ids[--size];
            for (int32_t j = 0;;) {   /* sift down */
                int32_t c = 2 * j + 1, m = j;
                if (c < size && (x[ids[c]] < x[ids[m]] || (x[ids[c]] == x[ids[m]] && ids[c] > ids[m]))) m = c;
                if (c + 1 < size && (x[ids[c + 1]] < x[ids[m]] ||
                                     (x[ids[c + 1]] == x[ids[m]] && ids[c + 1] > ids[m]))) m = c + 1;
                if (m == j) break;
                const int32_t t = ids[j]; ids[j] = ids[m]; ids[m] = t;
                j = m;
            }
        }
        int32_t j = size++;   /* sift up */
        ids[j] = i;
        while (j > 0) {
            const int32_t p = (j - 1) / 2;
            if (x[ids[p]] < x[ids[j]] || (x[ids[p]] == x[ids[j]] && ids[p] > ids[j])) break;
            const int32_t t = ids[j]; ids[j] = ids[p]; ids[p] = t;
            j = p;
        }
    }
    sort_desc(ids, size, x);
}

/* Top-k first looks at the tokens within this many logits of the best. */
#define TOP_K_MARGIN 8.0f

/* Keeps the selected ids whose value is at least cut; returns how many. */
static int32_t keep_at_least(const float *x, int32_t *sel, int32_t n_sel, float cut) {
    int32_t kept = 0;
    for (int32_t i = 0; i < n_sel; i++)
        if (x[sel[i]] >= cut) sel[kept++] = sel[i];
    return kept;
}

/* The k highest of the n entries of x into ids, highest first. The heap only
 * sees the tokens within a logit margin of the best, m (a row has few tokens
 * near its best): sel holds a scan's selection, a superset of them (room for
 * n). The margin is widened, with a new selection pass, until it holds k. */
static int32_t top_k_near_best(const pp_sampling_math *math, const float *x, int32_t n, int32_t k, float m,
                               float margin, int32_t *sel, int32_t n_sel, int32_t *ids) {
    float cut = m - margin;
    n_sel = keep_at_least(x, sel, n_sel, cut);
    while (n_sel < k && cut > -INFINITY) {
        margin *= 2.0f;
        cut = margin < 1e30f ? m - margin : -INFINITY;
        n_sel = math->select_at_least(x, n, cut, sel);
    }
    if (k > n_sel) k = n_sel;   /* NaNs are never selected */
    top_k_ids(x, sel, n_sel, k, ids);
    return k;
}

/* Candidates beyond this many are not sorted (see nucleus_front). */
#define SORT_LIMIT 2048

/* Keeps the ids weighing at least cut; returns how many. */
static int32_t keep_weighing_at_least(int32_t *ids, int32_t n, const float *w, float cut) {
    int32_t kept = 0;
    for (int32_t i = 0; i < n; i++)
        if (w[ids[i]] >= cut) ids[kept++] = ids[i];
    return kept;
}

/* Buckets of nucleus_front: a weight in (0, 1] by its float bits' top 13
 * (sign, exponent and 4 mantissa bits), so a higher bucket is a higher weight. */
#define NUCLEUS_BUCKET_SHIFT 19
#define NUCLEUS_BUCKETS ((0x3f800000u >> NUCLEUS_BUCKET_SHIFT) + 1)

static uint32_t weight_bucket(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits >> NUCLEUS_BUCKET_SHIFT;   /* v in [0, 1]: at most NUCLEUS_BUCKETS - 1 */
}

/* Moves the nucleus, the fewest highest-weighted of the n ids whose weights
 * (in (0, 1]) add up to at least target > 0 (all n if they never do), to the
 * front of ids and returns its size. One pass sums the weights per bucket of
 * their float bits, which finds the bucket where the nucleus ends; only that
 * bucket's tokens are sorted. Linear in n: a flat row (a high temperature)
 * has tens of thousands of tokens in its nucleus. */
static int32_t nucleus_front(int32_t *ids, int32_t n, const float *w, double target, int32_t *spare) {
    static _Thread_local double mass[NUCLEUS_BUCKETS];
    memset(mass, 0, sizeof mass);
    for (int32_t i = 0; i < n; i++) mass[weight_bucket(w[ids[i]])] += w[ids[i]];
    double cum = 0.0;
    int32_t edge = (int32_t)NUCLEUS_BUCKETS - 1;
    for (; edge > 0; edge--) {
        if (cum + mass[edge] >= target) break;
        cum += mass[edge];
    }
    /* tokens above the edge bucket first (id order), then the edge bucket's, sorted */
    int32_t above = 0, at = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t b = (int32_t)weight_bucket(w[ids[i]]);
        if (b > edge) ids[above++] = ids[i];
        else if (b == edge) spare[at++] = ids[i];
    }
    sort_desc(spare, at, w);
    int32_t keep = above;
    for (int32_t i = 0; i < at; i++) {
        ids[keep++] = spare[i];
        cum += w[spare[i]];
        if (cum >= target) break;
    }
    return keep > 0 ? keep : (n > 0 ? 1 : 0);
}

/* Draws one of ids[0, keep) (keep >= 1 is made so) in proportion to its
 * weight, u uniform in [0, 1). */
static int32_t draw(const int32_t *ids, int32_t keep, const float *w, double u) {
    if (keep < 1) keep = 1;
    double kept = 0.0;
    for (int32_t i = 0; i < keep; i++) kept += w[ids[i]];
    const double target = u * kept;
    double cum = 0.0;
    int32_t i = 0;
    for (; i < keep - 1; i++) {
        cum += w[ids[i]];
        if (cum > target) break;
    }
    return ids[i];
}

/* Repetition (llama.cpp's: divide positive logits, multiply negative ones),
 * presence and frequency penalties, once per distinct token of history. */
static void apply_penalties(float *row, const pp_sample_row *r, int32_t *scratch) {
    const pp_sampling_params *sp = &r->params;
    memcpy(scratch, r->history, sizeof(int32_t) * (size_t)r->n_history);
    qsort(scratch, (size_t)r->n_history, sizeof *scratch, cmp_int32);
    for (int32_t i = 0; i < r->n_history;) {
        int32_t j = i;
        while (j < r->n_history && scratch[j] == scratch[i]) j++;
        float *v = &row[scratch[i]];
        if (sp->repeat_penalty != 1.0f) *v = *v > 0 ? *v / sp->repeat_penalty : *v * sp->repeat_penalty;
        *v -= (float)(j - i) * sp->frequency_penalty + sp->presence_penalty;
        /* huge penalties overflow: a NaN never wins, +inf is the largest finite score */
        if (isnan(*v)) *v = -INFINITY;
        else if (*v > FLT_MAX) *v = FLT_MAX;
        i = j;
    }
}

/* ---- one row ------------------------------------------------------------- */

/* The logit at or above which a token weighs at least threshold relative to
 * the best (weight = e^((logit - m) / T)), a hair lower so that rounding
 * never leaves out a token the exact weights would keep. */
static float logit_cut(float m, float temperature, float threshold) {
    const float cut = m + temperature * logf(threshold);
    return cut - fabsf(cut) * 1e-6f - 1e-6f;
}

/* Temperature alone: the token where the cumulative mass passes u * z, found
 * from the row's partial sums; only the block holding it is weighed token by
 * token. */
static int32_t draw_by_mass(const float *row, int32_t n, float m, float inv_t, const float *block_sums,
                            double target, int32_t fallback) {
    double cum = 0.0;
    for (int32_t start = 0; start < n; start += PP_SUM_BLOCK) {
        const float bs = block_sums[start / PP_SUM_BLOCK];
        if (cum + bs <= target) {
            cum += bs;
            continue;
        }
        const int32_t end = start + PP_SUM_BLOCK < n ? start + PP_SUM_BLOCK : n;
        int32_t token = fallback;
        for (int32_t i = start; i < end; i++) {
            const float wi = expf((row[i] - m) * inv_t);
            if (!(wi > 0.0f)) continue;
            token = i;
            cum += wi;
            if (cum > target) break;
        }
        return token;   /* rounding between the two sums: the block's last weighed token */
    }
    return fallback;
}

static int sample_row(const pp_sampler *s, sampler_scratch *sc, const float *logits, const pp_sample_row *r,
                      pp_sample_result *out) {
    const pp_sampling_params *sp = &r->params;
    const pp_sampling_math *math = s->math;
    const int32_t n = s->n_vocab;
    const float *row = logits;
    const int penalized = r->n_history > 0 && (sp->repeat_penalty != 1.0f || sp->presence_penalty != 0.0f ||
                                               sp->frequency_penalty != 0.0f);
    if (penalized || r->allowed) {
        memcpy(sc->row, logits, sizeof(float) * (size_t)n);
        if (penalized) apply_penalties(sc->row, r, sc->history);
        if (r->allowed)
            for (int32_t i = 0; i < n; i++)
                if (!r->allowed[i]) sc->row[i] = -INFINITY;
        row = sc->row;
    }
    /* One read of the row finds the best token and, depending on the
     * parameters, the mass, partial masses and candidates. */
    const int greedy = sp->temperature <= 1e-6f;
    const int top_k = !greedy && sp->top_k > 0 && sp->top_k < n;
    const int mass_only = !greedy && !top_k && sp->top_p >= 1.0f && sp->min_p <= 0.0f;
    const int nucleus = !greedy && !top_k && !mass_only;
    const float floor_p = sp->min_p > 0.0f ? sp->min_p : 0.0f;   /* the best weighs 1 */
    float threshold = floor_p > 1e-4f ? floor_p : 1e-4f;           /* nucleus candidates weigh at least this */
    pp_row_scan scan = {
        .scale = greedy || top_k ? 0.0f : 1.0f / sp->temperature,
        /* a weight of at least threshold is a logit within -T ln(threshold) of the best */
        .margin = top_k ? TOP_K_MARGIN : nucleus ? -sp->temperature * logf(threshold) * (1.0f + 1e-6f) + 1e-6f : 0.0f,
        .ids = top_k || nucleus ? sc->selected : NULL,
        .block_sums = mass_only ? sc->block_sums : NULL,
        .block_refs = mass_only ? sc->block_refs : NULL,
    };
    math->scan_row(row, n, &scan);
    const int32_t best = scan.best;
    if (!(row[best] > -INFINITY)) return PP_ERR_INVALID;   /* the caller names the row */
    const float m = row[best];

    /* Below 1e-6 a temperature only separates ties the argmax already broke;
     * dividing by it would overflow. */
    if (greedy) {
        out->token = best;
    } else {
        const float inv_t = 1.0f / sp->temperature;
        float *w = sc->weights;
        int32_t *ids = sc->cand;
        int32_t n_cand;
        double z = scan.mass;            /* the mass the nucleus is measured against */
        if (top_k) {
            n_cand = top_k_near_best(math, row, n, sp->top_k, m, TOP_K_MARGIN, sc->selected, scan.n_ids, ids);
            z = 0.0;
            for (int32_t i = 0; i < n_cand; i++) {
                w[ids[i]] = expf((row[ids[i]] - m) * inv_t);
                z += w[ids[i]];
            }
        } else if (mass_only) {
            out->token = draw_by_mass(row, n, m, inv_t, sc->block_sums, next_uniform(r->rng_state) * z, best);
            goto logprobs;
        } else {
            /* The scan selected the tokens above the threshold (and a few
             * more); lower it until they hold the nucleus. */
            int32_t *sel = sc->selected;
            n_cand = keep_at_least(row, sel, scan.n_ids, logit_cut(m, sp->temperature, threshold));
            int weighed_all = 0;   /* many candidates: every weight from one vector pass */
            for (;;) {
                double mass = 0.0;
                if (!weighed_all && n_cand > SORT_LIMIT) {
                    math->weigh_row(row, n, m, inv_t, w);
                    weighed_all = 1;
                }
                for (int32_t i = 0; i < n_cand; i++) {
                    if (!weighed_all) w[sel[i]] = expf((row[sel[i]] - m) * inv_t);
                    mass += w[sel[i]];
                }
                if (mass >= (double)sp->top_p * z || threshold <= floor_p || threshold < 1e-30f) break;
                /* a gentle step: the nucleus is rarely far below, and every token let in is weighed */
                threshold = threshold / 16.0f > floor_p ? threshold / 16.0f : floor_p;
                n_cand = math->select_at_least(row, n, logit_cut(m, sp->temperature, threshold), sel);
            }
            if (n_cand == 0) {   /* only when the best itself is not finite */
                sel[n_cand++] = best;
                w[best] = 1.0f;
            }
            memcpy(ids, sel, sizeof(int32_t) * (size_t)n_cand);
            if (n_cand > SORT_LIMIT) {
                /* A flat row (a high temperature) puts much of the vocabulary
                 * in the nucleus: find it without sorting it. The best weighs 1. */
                int32_t keep = sp->min_p > 0.0f ? keep_weighing_at_least(ids, n_cand, w, sp->min_p) : n_cand;
                if (sp->top_p < 1.0f) keep = nucleus_front(ids, keep, w, (double)sp->top_p * z, sc->selected);
                out->token = draw(ids, keep, w, next_uniform(r->rng_state));
                goto logprobs;
            }
            sort_desc(ids, n_cand, w);
        }
        /* min-p, then top-p over the candidates (probabilities relative to z) */
        int32_t keep = n_cand;
        if (sp->min_p > 0.0f) {
            const float cut = w[ids[0]] * sp->min_p;
            keep = 0;
            while (keep < n_cand && w[ids[keep]] >= cut) keep++;
        }
        if (sp->top_p < 1.0f) {
            double cum = 0.0;
            int32_t i = 0;
            while (i < keep) {
                cum += w[ids[i++]];
                if (cum >= (double)sp->top_p * z) break;
            }
            keep = i;
        }
        out->token = draw(ids, keep, w, next_uniform(r->rng_state));
    }
logprobs:
    out->n_top = 0;
    out->logprob = 0.0f;
    if (sp->n_logprobs >= 0) {
        /* The model's own distribution: the raw row, before penalties and temperature. */
        const int32_t k = sp->n_logprobs < PP_SAMPLE_MAX_TOP ? sp->n_logprobs : PP_SAMPLE_MAX_TOP;
        pp_row_scan raw = {.scale = 1.0f, .margin = TOP_K_MARGIN, .ids = k > 0 ? sc->selected : NULL};
        math->scan_row(logits, n, &raw);
        const double lse = (double)logits[raw.best] + log(raw.mass);
        out->logprob = (float)(logits[out->token] - lse);
        if (k > 0) {
            const int32_t got = top_k_near_best(math, logits, n, k, logits[raw.best], TOP_K_MARGIN, sc->selected,
                                                raw.n_ids, sc->cand);
            for (int32_t j = 0; j < got; j++) {
                out->top_ids[j] = sc->cand[j];
                out->top_logprobs[j] = (float)(logits[sc->cand[j]] - lse);
            }
            out->n_top = got;
        }
    }
    return PP_OK;
}

typedef struct sample_job {
    const pp_sampler *s;
    sampler_scratch *scratch;
    const float *logits;
    const pp_sample_row *rows;
    int32_t n_rows;
    pp_sample_result *out;
    int32_t first, stride;
    int32_t failed_row;   /* -1, or the first row that allowed no token */
} sample_job;

static void *sample_rows(void *arg) {
    sample_job *job = arg;
    for (int32_t i = job->first; i < job->n_rows; i += job->stride) {
        const pp_sample_row *r = &job->rows[i];
        if (sample_row(job->s, job->scratch, job->logits + (size_t)r->logit_row * job->s->n_vocab, r,
                       &job->out[i]) != PP_OK && job->failed_row < 0)
            job->failed_row = i;
    }
    return NULL;
}

int pp_sample(pp_sampler *s, const float *logits, int32_t n_logit_rows, const pp_sample_row *rows,
              int32_t n_rows, pp_sample_result *out) {
    if (!s || !logits || (n_rows > 0 && (!rows || !out)) || n_rows < 0)
        return pp_fail(PP_ERR_INVALID, "pp_sample: NULL or negative argument");
    for (int32_t i = 0; i < n_rows; i++) {
        const pp_sample_row *r = &rows[i];
        const pp_sampling_params *sp = &r->params;
        if (r->logit_row < 0 || r->logit_row >= n_logit_rows)
            return pp_fail(PP_ERR_INVALID, "sample %d: logit row %d outside [0, %d)", i, r->logit_row, n_logit_rows);
        if (!r->rng_state || r->n_history < 0 || (r->n_history > 0 && !r->history))
            return pp_fail(PP_ERR_INVALID, "sample %d: missing generator state or history", i);
        if (!(sp->temperature >= 0.0f) || sp->top_k < 0 || !(sp->top_p > 0.0f && sp->top_p <= 1.0f) ||
            !(sp->min_p >= 0.0f && sp->min_p <= 1.0f) || !(sp->repeat_penalty > 0.0f) ||
            sp->n_logprobs > PP_SAMPLE_MAX_TOP)
            return pp_fail(PP_ERR_INVALID, "sample %d: sampling parameters out of range", i);
        for (int32_t j = 0; j < r->n_history; j++)
            if (r->history[j] < 0 || r->history[j] >= s->n_vocab)
                return pp_fail(PP_ERR_INVALID, "sample %d: history token %d outside the vocabulary", i,
                               r->history[j]);
    }
    if (n_rows == 0) return PP_OK;
    /* Rows go to threads round-robin; each thread grows its own history buffer first. */
    const int32_t n_threads = n_rows < s->n_threads ? n_rows : s->n_threads;
    for (int32_t t = 0; t < n_threads; t++) {
        int32_t longest = 0;
        for (int32_t i = t; i < n_rows; i += n_threads)
            if (rows[i].n_history > longest) longest = rows[i].n_history;
        sampler_scratch *sc = &s->scratch[t];
        if (longest > sc->history_capacity) {
            int32_t *grown = realloc(sc->history, sizeof(int32_t) * (size_t)longest);
            if (!grown) return pp_fail(PP_ERR_NO_MEMORY, "cannot hold a history of %d tokens", longest);
            sc->history = grown;
            sc->history_capacity = longest;
        }
    }
    sample_job jobs[64];
    pthread_t workers[64];
    int started[64] = {0};
    for (int32_t t = 0; t < n_threads; t++)
        jobs[t] = (sample_job){s, &s->scratch[t], logits, rows, n_rows, out, t, n_threads, -1};
    for (int32_t t = 1; t < n_threads; t++)   /* a thread that cannot start leaves its rows to us */
        started[t] = pthread_create(&workers[t], NULL, sample_rows, &jobs[t]) == 0;
    sample_rows(&jobs[0]);
    for (int32_t t = 1; t < n_threads; t++) {
        if (started[t]) pthread_join(workers[t], NULL);
        else sample_rows(&jobs[t]);
    }
    for (int32_t t = 0; t < n_threads; t++)
        if (jobs[t].failed_row >= 0)
            return pp_fail(PP_ERR_INVALID, "row %d: no token is allowed (or its logits are not finite)",
                           rows[jobs[t].failed_row].logit_row);
    return PP_OK;
}
