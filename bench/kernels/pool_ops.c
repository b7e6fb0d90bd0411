/* Block-pool operation throughput straight through the C API.
 *
 * Built and run by bench/pool_ops.py (cc -O2 against the installed package's
 * header and libpyllama_paged.so); the Python side runs the same workload
 * through pyllama_paged.BlockPool so the two can be put side by side.
 *
 * Workload (per request): create a sequence from a prompt_len-token prompt,
 * append gen_len tokens one at a time, fork it once, free the child and the
 * parent. Token ids never repeat, so no prefix-cache hits: every full block
 * that is freed becomes a cached block, and once the free list is used up new
 * blocks come from evicting the least recently used cached block (the steady
 * state of a warm server).
 *
 * Two measurements:
 *   phased: rounds of R concurrent requests; each phase is timed on its own:
 *           create R sequences; 50 passes appending one token to each of the R
 *           (decode-like interleaving); fork each; free the R children and the
 *           R parents. ops/s per phase = ops in the phase / time in the phase.
 *   cycle:  one request at a time, its whole life (create, gen_len appends,
 *           fork, 2 frees) back to back; requests/s.
 * Each measurement runs rounds until it has at least min_time seconds, and is
 * repeated `repeats` times; the best (fastest) repeat is reported, the usual
 * choice on a shared, noisy machine.
 *
 * Usage: pool_ops BLOCK_SIZE NUM_BLOCKS R PROMPT_LEN GEN_LEN MIN_TIME_S REPEATS
 * Prints one JSON object on stdout.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "pyllama_paged.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define CHECK(call)                                                                   \
    do {                                                                              \
        int st_ = (call);                                                             \
        if (st_ != PP_OK) {                                                           \
            fprintf(stderr, "pool_ops: %s failed (%d): %s\n", #call, st_, pp_last_error()); \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

typedef struct {
    int32_t block_size, num_blocks, R, prompt_len, gen_len, repeats;
    double min_time;
} config;

typedef struct {
    double t_create, t_append, t_fork, t_free;
    int64_t n_create, n_append, n_fork, n_free;
} phase_times;

static uint32_t next_token_base = 1;

/* prompt_len distinct token ids for the next request. */
static void fill_prompt(int32_t *buf, int32_t n) {
    for (int32_t i = 0; i < n; i++) buf[i] = (int32_t)((next_token_base + (uint32_t)i) & 0x7fffffff);
    next_token_base += (uint32_t)n + 1000u;
}

/* R fresh prompts (untimed); returns the first of the R * gen_len tokens their answers take. */
static uint32_t fill_prompts(int32_t *prompts, const config *c) {
    for (int32_t j = 0; j < c->R; j++) fill_prompt(prompts + (size_t)j * c->prompt_len, c->prompt_len);
    uint32_t tok = next_token_base;
    next_token_base += (uint32_t)(c->R * c->gen_len) + 1000u;
    return tok;
}

static phase_times run_phased(pp_block_pool *pool, const config *c, int32_t *prompts,
                              int32_t *parents, int32_t *children) {
    phase_times pt = {0};
    pp_block_copy copy;
    int32_t ncopies;
    double elapsed = 0;
    while (elapsed < c->min_time) {
        uint32_t tok = fill_prompts(prompts, c);

        double t0 = now_s();
        for (int32_t j = 0; j < c->R; j++)
            CHECK(pp_seq_create(pool, prompts + (size_t)j * c->prompt_len, c->prompt_len,
                                &parents[j], NULL));
        double t1 = now_s();
        for (int32_t k = 0; k < c->gen_len; k++)
            for (int32_t j = 0; j < c->R; j++) {
                int32_t t = (int32_t)(tok++ & 0x7fffffff);
                CHECK(pp_seq_append(pool, parents[j], &t, 1, &copy, 1, &ncopies));
            }
        double t2 = now_s();
        for (int32_t j = 0; j < c->R; j++) CHECK(pp_seq_fork(pool, parents[j], &children[j]));
        double t3 = now_s();
        for (int32_t j = 0; j < c->R; j++) {
            CHECK(pp_seq_free(pool, children[j]));
            CHECK(pp_seq_free(pool, parents[j]));
        }
        double t4 = now_s();

        pt.t_create += t1 - t0;
        pt.t_append += t2 - t1;
        pt.t_fork += t3 - t2;
        pt.t_free += t4 - t3;
        pt.n_create += c->R;
        pt.n_append += (int64_t)c->R * c->gen_len;
        pt.n_fork += c->R;
        pt.n_free += 2 * (int64_t)c->R;
        elapsed += t4 - t0;
    }
    return pt;
}

/* Whole requests back to back; returns requests per second. */
static double run_cycle(pp_block_pool *pool, const config *c, int32_t *prompt, int64_t *n_out) {
    pp_block_copy copy;
    int32_t ncopies, parent, child;
    int64_t n = 0;
    double busy = 0;
    while (busy < c->min_time) {
        /* Batches of R requests between clock reads; prompts made untimed. */
        uint32_t tok = fill_prompts(prompt, c);
        double t0 = now_s();
        for (int32_t j = 0; j < c->R; j++) {
            CHECK(pp_seq_create(pool, prompt + (size_t)j * c->prompt_len, c->prompt_len, &parent, NULL));
            for (int32_t k = 0; k < c->gen_len; k++) {
                int32_t t = (int32_t)(tok++ & 0x7fffffff);
                CHECK(pp_seq_append(pool, parent, &t, 1, &copy, 1, &ncopies));
            }
            CHECK(pp_seq_fork(pool, parent, &child));
            CHECK(pp_seq_free(pool, child));
            CHECK(pp_seq_free(pool, parent));
        }
        busy += now_s() - t0;
        n += c->R;
    }
    *n_out = n;
    return (double)n / busy;
}

static double rate(int64_t n, double t) { return t > 0 ? (double)n / t : 0.0; }

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s BLOCK_SIZE NUM_BLOCKS R PROMPT_LEN GEN_LEN MIN_TIME_S REPEATS\n",
                argv[0]);
        return 2;
    }
    config c;
    c.block_size = atoi(argv[1]);
    c.num_blocks = atoi(argv[2]);
    c.R = atoi(argv[3]);
    c.prompt_len = atoi(argv[4]);
    c.gen_len = atoi(argv[5]);
    c.min_time = atof(argv[6]);
    c.repeats = atoi(argv[7]);
    if (c.R < 1 || c.prompt_len < 1 || c.gen_len < 0 || c.repeats < 1) {
        fprintf(stderr, "pool_ops: bad arguments\n");
        return 2;
    }

    pp_block_pool *pool = NULL;
    CHECK(pp_pool_create(c.num_blocks, c.block_size, &pool));
    int32_t *prompts = malloc(sizeof(int32_t) * (size_t)c.R * (size_t)c.prompt_len);
    int32_t *parents = malloc(sizeof(int32_t) * (size_t)c.R);
    int32_t *children = malloc(sizeof(int32_t) * (size_t)c.R);
    if (!prompts || !parents || !children) {
        fprintf(stderr, "pool_ops: out of memory\n");
        return 1;
    }

    /* Warm-up: one short pass of each so page faults and the free list's
     * first use are not timed. */
    config warm = c;
    warm.min_time = 0.0;
    (void)run_phased(pool, &warm, prompts, parents, children);

    double best_create = 0, best_append = 0, best_fork = 0, best_free = 0, best_cycle = 0;
    int64_t cycle_n = 0;
    for (int r = 0; r < c.repeats; r++) {
        phase_times pt = run_phased(pool, &c, prompts, parents, children);
        double v;
        if ((v = rate(pt.n_create, pt.t_create)) > best_create) best_create = v;
        if ((v = rate(pt.n_append, pt.t_append)) > best_append) best_append = v;
        if ((v = rate(pt.n_fork, pt.t_fork)) > best_fork) best_fork = v;
        if ((v = rate(pt.n_free, pt.t_free)) > best_free) best_free = v;
        int64_t n;
        if ((v = run_cycle(pool, &c, prompts, &n)) > best_cycle) best_cycle = v;
        cycle_n += n;
    }

    pp_pool_stats s;
    CHECK(pp_pool_stats_get(pool, &s));
    printf("{\"impl\": \"C\", \"version\": \"%s\", \"block_size\": %d, \"num_blocks\": %d, "
           "\"concurrency\": %d, \"prompt_len\": %d, \"gen_len\": %d, \"min_time_s\": %g, "
           "\"repeats\": %d, \"ops_per_s\": {\"create\": %.1f, \"append\": %.1f, \"fork\": %.1f, "
           "\"free\": %.1f, \"cycle\": %.1f}, \"cycle_requests\": %lld, "
           "\"final_stats\": {\"num_free\": %d, \"num_used\": %d, \"num_cached\": %d, "
           "\"num_seqs\": %d, \"num_evictions\": %lld, \"num_hits\": %lld}}\n",
           pp_version(), c.block_size, c.num_blocks, c.R, c.prompt_len, c.gen_len, c.min_time,
           c.repeats, best_create, best_append, best_fork, best_free, best_cycle,
           (long long)cycle_n, s.num_free, s.num_used, s.num_cached, s.num_seqs,
           (long long)s.num_evictions, (long long)s.num_hits);

    free(prompts);
    free(parents);
    free(children);
    pp_pool_destroy(pool);
    return 0;
}
