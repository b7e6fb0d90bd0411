/* The batched sampler: every row a step samples, in one call, from the
 * logits the step left in memory. Greedy, temperature, top-k, top-p, min-p,
 * repetition/presence/frequency penalties, an optional token mask, a seeded
 * generator per sequence, and log-probabilities only for rows that ask.
 *
 * The vocabulary is never sorted. Top-k keeps a heap of k candidates; top-p
 * and min-p take the tokens above a probability threshold, sort only those,
 * and lower the threshold in the rare case they do not yet hold the nucleus
 * (every token left out is less likely than every token kept, so the result
 * is exact). Without top-k, top-p or min-p the token is drawn straight from
 * the exponentiated row by its cumulative mass. */
#include "attention_math.h"
#include "pp_internal.h"
#include "pyllama_paged.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct pp_sampler {
    int32_t  n_vocab;
    int32_t *history;    /* a row's history, sorted for counting; grown on demand */
    int32_t  history_capacity;
    float   *row;        /* [n_vocab] the row after penalties and mask */
    float   *weights;    /* [n_vocab] exp((logit - max) / temperature) */
    int32_t *ids;        /* [n_vocab] candidate ids */
    const pp_attention_math *math;   /* vectorized exp */
};

int pp_sampler_create(int32_t n_vocab, pp_sampler **out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_sampler_create: out is NULL");
    *out = NULL;
    if (n_vocab < 1) return pp_fail(PP_ERR_INVALID, "n_vocab must be >= 1, got %d", n_vocab);
    pp_sampler *s = calloc(1, sizeof *s);
    if (s) {
        s->n_vocab = n_vocab;
        s->row = malloc(sizeof(float) * (size_t)n_vocab);
        s->weights = malloc(sizeof(float) * (size_t)n_vocab);
        s->ids = malloc(sizeof(int32_t) * (size_t)n_vocab);
        s->math = pp_attention_math_select();
    }
    if (!s || !s->row || !s->weights || !s->ids) {
        pp_sampler_destroy(s);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a sampler for %d tokens", n_vocab);
    }
    *out = s;
    return PP_OK;
}

void pp_sampler_destroy(pp_sampler *s) {
    if (!s) return;
    free(s->history);
    free(s->row);
    free(s->weights);
    free(s->ids);
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

static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* The k highest of x (k <= n) into ids, highest first: a min-heap of k. */
static void top_k_ids(const float *x, int32_t n, int32_t k, int32_t *ids) {
    int32_t size = 0;
    for (int32_t i = 0; i < n; i++) {
        if (size == k) {
            const int32_t root = ids[0];
            if (x[i] < x[root] || (x[i] == x[root] && i > root)) continue;
            ids[0] = ids[--size];
            /* sift down */
            for (int32_t j = 0;;) {
                int32_t c = 2 * j + 1, m = j;
                if (c < size && (x[ids[c]] < x[ids[m]] || (x[ids[c]] == x[ids[m]] && ids[c] > ids[m]))) m = c;
                if (c + 1 < size && (x[ids[c + 1]] < x[ids[m]] ||
                                     (x[ids[c + 1]] == x[ids[m]] && ids[c + 1] > ids[m]))) m = c + 1;
                if (m == j) break;
                const int32_t t = ids[j]; ids[j] = ids[m]; ids[m] = t;
                j = m;
            }
        }
        /* sift up */
        int32_t j = size++;
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
        i = j;
    }
}

/* log-sum-exp of x over n entries, using w as scratch. */
static double log_sum_exp(const pp_sampler *s, const float *x, int32_t n, float *w) {
    const float m = x[argmax(x, n)];
    memcpy(w, x, sizeof(float) * (size_t)n);
    return (double)m + log((double)s->math->exp_shifted(w, n, m));
}

/* ---- one row ------------------------------------------------------------- */

static int sample_row(pp_sampler *s, const float *logits, const pp_sample_row *r, pp_sample_result *out) {
    const pp_sampling_params *sp = &r->params;
    const int32_t n = s->n_vocab;
    const float *row = logits;
    const int penalized = r->n_history > 0 && (sp->repeat_penalty != 1.0f || sp->presence_penalty != 0.0f ||
                                               sp->frequency_penalty != 0.0f);
    if (penalized || r->allowed) {
        memcpy(s->row, logits, sizeof(float) * (size_t)n);
        if (penalized) apply_penalties(s->row, r, s->history);
        if (r->allowed)
            for (int32_t i = 0; i < n; i++)
                if (!r->allowed[i]) s->row[i] = -INFINITY;
        row = s->row;
    }
    const int32_t best = argmax(row, n);
    if (!(row[best] > -INFINITY))
        return pp_fail(PP_ERR_INVALID, "row %d: no token is allowed (or the logits are not finite)", r->logit_row);

    if (sp->temperature <= 0.0f) {
        out->token = best;
    } else {
        const float inv_t = 1.0f / sp->temperature;
        float *w = s->weights;
        int32_t *ids = s->ids;
        int32_t n_cand;
        double z;                        /* the mass the nucleus is measured against */
        const int filtered = (sp->top_k > 0 && sp->top_k < n) || sp->top_p < 1.0f || sp->min_p > 0.0f;
        if (sp->top_k > 0 && sp->top_k < n) {
            n_cand = sp->top_k;
            top_k_ids(row, n, n_cand, ids);
            z = 0.0;
            for (int32_t i = 0; i < n_cand; i++) {
                w[ids[i]] = expf((row[ids[i]] - row[best]) * inv_t);
                z += w[ids[i]];
            }
        } else {
            for (int32_t i = 0; i < n; i++) w[i] = row[i] * inv_t;
            z = s->math->exp_shifted(w, n, row[best] * inv_t);   /* w[i] = exp((row[i] - max) / T) */
            if (!filtered) {                 /* plain temperature: draw by cumulative mass, no candidates */
                const double target = next_uniform(r->rng_state) * z;
                double cum = 0.0;
                int32_t i = 0, last = best;
                for (; i < n; i++) {
                    if (w[i] <= 0.0f) continue;
                    last = i;
                    cum += w[i];
                    if (cum > target) break;
                }
                out->token = i < n ? i : last;
                goto logprobs;
            }
            /* Candidates: the tokens above a threshold, sorted; lower it until they hold the nucleus. */
            const float floor_p = sp->min_p > 0.0f ? sp->min_p : 0.0f;   /* w is 1 at the max */
            float threshold = floor_p > 1e-3f ? floor_p : 1e-3f;
            for (;;) {
                n_cand = 0;
                double mass = 0.0;
                for (int32_t i = 0; i < n; i++)
                    if (w[i] >= threshold && w[i] > 0.0f) {
                        ids[n_cand++] = i;
                        mass += w[i];
                    }
                if (mass >= (double)sp->top_p * z || threshold <= floor_p || threshold < 1e-30f) break;
                threshold = threshold / 64.0f > floor_p ? threshold / 64.0f : floor_p;
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
        if (keep < 1) keep = 1;
        double kept = 0.0;
        for (int32_t i = 0; i < keep; i++) kept += w[ids[i]];
        const double target = next_uniform(r->rng_state) * kept;
        double cum = 0.0;
        int32_t i = 0;
        for (; i < keep - 1; i++) {
            cum += w[ids[i]];
            if (cum > target) break;
        }
        out->token = ids[i];
    }
logprobs:
    out->n_top = 0;
    out->logprob = 0.0f;
    if (sp->n_logprobs >= 0) {
        /* The model's own distribution: the raw row, before penalties and temperature. */
        const double lse = log_sum_exp(s, logits, n, s->weights);
        out->logprob = (float)(logits[out->token] - lse);
        const int32_t k = sp->n_logprobs < PP_SAMPLE_MAX_TOP ? sp->n_logprobs : PP_SAMPLE_MAX_TOP;
        if (k > 0) {
            top_k_ids(logits, n, k, s->ids);
            for (int32_t j = 0; j < k; j++) {
                out->top_ids[j] = s->ids[j];
                out->top_logprobs[j] = (float)(logits[s->ids[j]] - lse);
            }
            out->n_top = k;
        }
    }
    return PP_OK;
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
    int32_t longest = 0;
    for (int32_t i = 0; i < n_rows; i++)
        if (rows[i].n_history > longest) longest = rows[i].n_history;
    if (longest > s->history_capacity) {
        int32_t *grown = realloc(s->history, sizeof(int32_t) * (size_t)longest);
        if (!grown) return pp_fail(PP_ERR_NO_MEMORY, "cannot hold a history of %d tokens", longest);
        s->history = grown;
        s->history_capacity = longest;
    }
    for (int32_t i = 0; i < n_rows; i++) {
        int st = sample_row(s, logits + (size_t)rows[i].logit_row * s->n_vocab, &rows[i], &out[i]);
        if (st != PP_OK) return st;
    }
    return PP_OK;
}
