/* The batched sampler: every row a step samples, in one call, from the
 * logits the step left in memory. Greedy, temperature, top-k, top-p, min-p,
 * repetition/presence/frequency penalties, an optional token mask, a seeded
 * generator per sequence, and log-probabilities only for rows that ask.
 *
 * The vocabulary is never sorted and never copied. A row is a megabyte that
 * is not in cache, so each row is read once by a vectorized pass
 * (sampling_math.c) that finds the argmax and, as the parameters need,
 * per-block maxima (top-k then reads only the blocks that can hold its
 * candidates; only those few are weighed and sorted) or every token's
 * weight with per-block sums. Temperature, top-p and min-p then draw from the whole distribution
 * by cumulative mass and keep the draw only if it lies in the nucleus,
 * which one pass over the stored weights tells (rejection sampling: exact,
 * and a draw is kept at least top_p of the time); after a few misses the
 * nucleus is found outright. */
#include "common/pp_internal.h"
#include "kernels/sampling_math.h"
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
    float   *weights;    /* [n_vocab] exp((logit - max) / temperature): every token's, or top-k's candidates' */
    int32_t *cand;       /* [n_vocab] candidate ids, best first */
    int32_t *selected;   /* [n_vocab] ids a selection pass found, in id order */
    float   *block_sums; /* [n_vocab / PP_SUM_BLOCK + 1] partial masses of a row */
    float   *block_refs; /* [n_vocab / PP_SUM_BLOCK + 1] the scan's scratch */
    float   *block_maxes;/* [n_vocab / PP_SUM_BLOCK + 1] each block's largest logit */
} sampler_scratch;

struct pp_sampler {
    int32_t  n_vocab;
    int32_t  n_threads;
    sampler_scratch *scratch;        /* one per thread */
    const pp_sampling_math *math;    /* the vectorized passes over a row */
};

int32_t pp_sampler_create(int32_t n_vocab, int32_t n_threads, pp_sampler **out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_sampler_create: out is NULL");
    *out = NULL;
    if (n_vocab < 1) return pp_fail(PP_ERR_INVALID, "n_vocab must be >= 1, got %d", n_vocab);
    if (n_threads < 1 || n_threads > PP_SAMPLER_MAX_THREADS)
        return pp_fail(PP_ERR_INVALID, "n_threads must be in [1, %d], got %d", PP_SAMPLER_MAX_THREADS, n_threads);
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
            sc->block_maxes = malloc(sizeof(float) * ((size_t)n_vocab / PP_SUM_BLOCK + 1));
            ok = sc->row && sc->weights && sc->cand && sc->selected && sc->block_sums && sc->block_refs &&
                 sc->block_maxes;
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
        free(s->scratch[t].block_maxes);
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

/* The k highest of the n entries of x into ids, highest first; returns how
 * many (NaNs never count). The k-th largest of the per-block maxima is a
 * floor for the k-th largest entry (k blocks each hold an entry at least as
 * large), so only the blocks reaching it are read, and only their entries
 * reaching it meet the heap: about k of a row's 262,144. A k beyond the
 * number of blocks widens a logit margin below the best, m, instead. sel
 * and ids have room for n. */
static int32_t top_k_of_row(const pp_sampling_math *math, const float *x, int32_t n, int32_t k, float m,
                            const float *block_maxes, int32_t *sel, int32_t *ids) {
    const int32_t n_blocks = (n + PP_SUM_BLOCK - 1) / PP_SUM_BLOCK;
    int32_t n_sel = 0;
    float floor_v = -INFINITY;
    if (k <= n_blocks) {
        top_k_ids(block_maxes, NULL, n_blocks, k, ids);
        /* fewer than k blocks hold a finite entry: every finite entry is a candidate */
        floor_v = block_maxes[ids[k - 1]] > -INFINITY ? block_maxes[ids[k - 1]] : -FLT_MAX;
    }
    if (floor_v > -INFINITY) {
        for (int32_t start = 0, b = 0; start < n; start += PP_SUM_BLOCK, b++) {
            if (!(block_maxes[b] >= floor_v)) continue;
            const int32_t len = start + PP_SUM_BLOCK < n ? PP_SUM_BLOCK : n - start;
            const int32_t got = math->select_at_least(x + start, len, floor_v, sel + n_sel);
            for (int32_t i = n_sel; i < n_sel + got; i++) sel[i] += start;
            n_sel += got;
        }
    } else {
        for (float margin = 8.0f;; margin *= 8.0f) {
            const float cut = margin < 1e30f ? m - margin : -FLT_MAX;
            n_sel = math->select_at_least(x, n, cut, sel);
            if (n_sel >= k || cut == -FLT_MAX) break;
        }
    }
    if (k > n_sel) k = n_sel;
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

/* Draws one of ids[0, n_cand) with weights w (a few candidates: top-k's):
 * sorted by weight, then min-p (relative to the best candidate) and top-p
 * (against z, the whole row's mass) applied. */
static int32_t draw_sorted(int32_t *ids, int32_t n_cand, const float *w, const pp_sampling_params *sp, double z,
                           uint64_t *rng) {
    sort_desc(ids, n_cand, w);
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
    return draw(ids, keep, w, next_uniform(rng));
}

/* The token where the cumulative weight passes target, found from the row's
 * block sums; only the block holding it is walked token by token. */
static int32_t draw_weighted(const float *w, int32_t n, const float *block_sums, double target, int32_t fallback) {
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
            if (!(w[i] > 0.0f)) continue;
            token = i;
            cum += w[i];
            if (cum > target) break;
        }
        return token;   /* rounding between the two sums: the block's last weighed token */
    }
    return fallback;
}

/* The mass of the tokens a sort by weight (ties: lower id first) puts
 * before token t. Blocks whose best logit is clearly below t's hold none:
 * their weights are good to about 1e-5, far inside e^-0.001. */
static double mass_before(const pp_sampling_math *math, const float *row, const float *w, int32_t n,
                          const float *block_maxes, int32_t t, float inv_t) {
    const float wt = w[t];
    double mass = 0.0;
    for (int32_t start = 0, b = 0; start < n; start += PP_SUM_BLOCK, b++) {
        if ((row[t] - block_maxes[b]) * inv_t > 1e-3f) continue;
        const int32_t end = start + PP_SUM_BLOCK < n ? start + PP_SUM_BLOCK : n;
        if (end <= t) {
            mass += math->mass_above(w + start, end - start, wt, 1);
        } else if (start > t) {
            mass += math->mass_above(w + start, end - start, wt, 0);
        } else {
            mass += math->mass_above(w + start, t - start, wt, 1);
            mass += math->mass_above(w + t + 1, end - t - 1, wt, 0);
        }
    }
    return mass;
}

/* Draws from the whole distribution are kept only if in the nucleus; kept
 * draws then follow the nucleus exactly (rejection sampling), and a draw
 * is kept with the nucleus's share of the mass: at least top_p when min-p
 * does not cut deeper. After this many misses the nucleus is found outright. */
#define NUCLEUS_TRIES 4

/* The nucleus outright: the tokens weighing at least a threshold, lowered
 * until they hold it; a few are sorted, many are bucketed (nucleus_front). */
static int32_t draw_nucleus_outright(const pp_sampling_math *math, sampler_scratch *sc, int32_t n,
                                     const pp_sampling_params *sp, const pp_row_scan *scan, uint64_t *rng) {
    const float *w = sc->weights;
    const float wb = w[scan->best];
    const double z = scan->mass;
    /* Down from the top in small steps: the draws missed, so the nucleus
     * is likely a small share of a flat row, and every token let in is counted. */
    float threshold = sp->min_p > 0.5f ? sp->min_p : 0.5f;
    int32_t *ids = sc->cand, n_cand;
    for (;;) {
        n_cand = math->select_at_least(w, n, threshold * wb, ids);
        double mass = 0.0;
        for (int32_t i = 0; i < n_cand; i++) mass += w[ids[i]];
        if (mass >= (double)sp->top_p * z || threshold <= sp->min_p || threshold < 1e-30f) break;
        threshold = threshold / 4.0f > sp->min_p ? threshold / 4.0f : sp->min_p;
    }
    if (n_cand == 0) return scan->best;   /* only when the best itself weighs nothing */
    if (n_cand <= SORT_LIMIT) return draw_sorted(ids, n_cand, w, sp, z, rng);
    /* A flat row (a high temperature) puts much of the vocabulary in the
     * nucleus: find it without sorting it. */
    int32_t keep = sp->min_p > 0.0f ? keep_weighing_at_least(ids, n_cand, w, sp->min_p * wb) : n_cand;
    if (sp->top_p < 1.0f) keep = nucleus_front(ids, keep, w, (double)sp->top_p * z, sc->selected);
    return draw(ids, keep, w, next_uniform(rng));
}

static int32_t draw_nucleus(const pp_sampling_math *math, sampler_scratch *sc, const float *row, int32_t n,
                            const pp_sampling_params *sp, const pp_row_scan *scan, uint64_t *rng) {
    const float *w = sc->weights;
    const float wb = w[scan->best], inv_t = 1.0f / sp->temperature;
    for (int attempt = 0; attempt < NUCLEUS_TRIES; attempt++) {
        const int32_t t = draw_weighted(w, n, sc->block_sums, next_uniform(rng) * scan->mass, scan->best);
        if (w[t] < sp->min_p * wb) continue;
        if (sp->top_p >= 1.0f ||
            mass_before(math, row, w, n, sc->block_maxes, t, inv_t) < (double)sp->top_p * scan->mass)
            return t;
    }
    return draw_nucleus_outright(math, sc, n, sp, scan, rng);
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
     * parameters, every token's weight or top-k's candidates. Below 1e-6 a
     * temperature only separates ties the argmax already broke; dividing by
     * it would overflow. */
    const int greedy = sp->temperature <= 1e-6f;
    const int top_k = !greedy && sp->top_k > 0 && sp->top_k < n;
    const int nucleus = !greedy && !top_k;
    pp_row_scan scan = {
        .scale = nucleus ? 1.0f / sp->temperature : 0.0f,
        .block_sums = nucleus ? sc->block_sums : NULL,
        .block_refs = nucleus ? sc->block_refs : NULL,
        .block_maxes = greedy ? NULL : sc->block_maxes,
        .weights = nucleus ? sc->weights : NULL,
    };
    math->scan_row(row, n, &scan);
    const int32_t best = scan.best;
    if (!(row[best] > -INFINITY)) return PP_ERR_INVALID;   /* the caller names the row */

    if (greedy) {
        out->token = best;
    } else if (top_k) {
        const float m = row[best], inv_t = 1.0f / sp->temperature;
        float *w = sc->weights;
        int32_t *ids = sc->cand;
        const int32_t n_cand = top_k_of_row(math, row, n, sp->top_k, m, sc->block_maxes, sc->selected, ids);
        double z = 0.0;
        for (int32_t i = 0; i < n_cand; i++) {
            w[ids[i]] = expf((row[ids[i]] - m) * inv_t);
            z += w[ids[i]];
        }
        out->token = draw_sorted(ids, n_cand, w, sp, z, r->rng_state);
    } else {
        out->token = draw_nucleus(math, sc, row, n, sp, &scan, r->rng_state);
    }
    out->n_top = 0;
    out->logprob = 0.0f;
    if (sp->n_logprobs >= 0) {
        /* The model's own distribution: the raw row, before penalties and temperature. */
        const int32_t k = sp->n_logprobs < PP_SAMPLE_MAX_TOP ? sp->n_logprobs : PP_SAMPLE_MAX_TOP;
        pp_row_scan raw = {.scale = 1.0f, .block_maxes = sc->block_maxes};
        math->scan_row(logits, n, &raw);
        const double lse = (double)logits[raw.best] + log(raw.mass);
        out->logprob = (float)(logits[out->token] - lse);
        if (k > 0) {
            const int32_t got = top_k_of_row(math, logits, n, k, logits[raw.best], sc->block_maxes, sc->selected,
                                             sc->cand);
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
                       &job->out[i]) != PP_OK) {
            job->out[i].token = -1;   /* tells the caller which rows failed */
            job->out[i].n_top = 0;
            if (job->failed_row < 0) job->failed_row = i;
        }
    }
    return NULL;
}

int32_t pp_sample(pp_sampler *s, const float *logits, int32_t n_logit_rows, const pp_sample_row *rows,
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
    sample_job jobs[PP_SAMPLER_MAX_THREADS];
    pthread_t workers[PP_SAMPLER_MAX_THREADS];
    int started[PP_SAMPLER_MAX_THREADS] = {0};
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
