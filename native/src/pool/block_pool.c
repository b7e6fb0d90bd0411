/* The block pool: physical KV blocks, their reference counts and states
 * (free, used, cached), the free list and the LRU list of cached blocks.
 * Sequences and their block tables are in block_table.c, copy-on-write in
 * copy_on_write.c, the prefix cache in prefix_cache.c. Eviction is the
 * pool's: it unlinks a cached block and tells the prefix cache to forget
 * it. It knows nothing of models or tensors: blocks are ints, tokens are ints. */
#include "pool/block_pool_internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

/* ---- block state transitions ------------------------------------------- */

static void lru_unlink(pp_block_pool *p, int32_t b) {
    int32_t prev = p->lru_prev[b], next = p->lru_next[b];
    if (prev >= 0) p->lru_next[prev] = next; else p->lru_head = next;
    if (next >= 0) p->lru_prev[next] = prev; else p->lru_tail = prev;
    p->num_cached--;
}

static void lru_push_newest(pp_block_pool *p, int32_t b) {
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    p->num_cached++;
}

static void make_free(pp_block_pool *p, int32_t b) {
    p->state[b] = PP_BLOCK_FREE;
    p->has_hash[b] = 0;
    p->computed[b] = 0;
    p->hash[b] = 0;
    p->parent_hash[b] = 0;
    p->num_filled[b] = 0;
    p->free_stack[p->num_free++] = b;
}

/* Caller has checked that a block is allocatable. Prefers never-cached free
 * blocks so cached prefixes survive as long as possible. */
int32_t pp_block_take(pp_block_pool *p, int32_t group) {
    int32_t b;
    if (p->num_free > 0) {
        b = p->free_stack[--p->num_free];
    } else {
        b = p->lru_head;
        lru_unlink(p, b);
        pp_prefix_forget(p, b);
        p->num_filled[b] = 0;
        p->num_evictions++;
    }
    p->computed[b] = 0;
    p->state[b] = PP_BLOCK_USED;
    p->ref_count[b] = 1;
    p->block_group[b] = group;
    return b;
}

void pp_block_ref_inc(pp_block_pool *p, int32_t b) {
    if (p->state[b] == PP_BLOCK_CACHED) {
        lru_unlink(p, b);
        p->state[b] = PP_BLOCK_USED;
        p->tokens_stored += p->num_filled[b];
    }
    if (++p->ref_count[b] == 2) p->num_shared++;
}

void pp_block_ref_dec(pp_block_pool *p, int32_t b) {
    int32_t r = --p->ref_count[b];
    if (r == 1) p->num_shared--;
    if (r > 0) return;
    p->tokens_stored -= p->num_filled[b];
    if (pp_prefix_is_registered(p, b) && p->computed[b]) {
        p->state[b] = PP_BLOCK_CACHED;
        lru_push_newest(p, b);
        return;
    }
    /* A block whose KV was never written must not be found by a later lookup. */
    if (pp_prefix_is_registered(p, b)) pp_prefix_forget(p, b);
    make_free(p, b);
}

/* ---- pool --------------------------------------------------------------- */

/* A fresh secret key for the pool's block hash (prefix_cache.c says why).
 * getrandom() does not fail for 16 bytes once the kernel's pool is ready; if
 * it ever does, the clock and addresses still make the key unpredictable
 * enough that no collision can be aimed from outside the process. */
static void random_key(uint64_t key[2]) {
    if (getrandom(key, 2 * sizeof(uint64_t), 0) == (ssize_t)(2 * sizeof(uint64_t))) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    key[0] = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)key;
    key[1] = (uint64_t)ts.tv_sec * 0xbf58476d1ce4e5b9ull ^ (uint64_t)(uintptr_t)&ts;
}

int32_t pp_pool_create(int32_t num_blocks, int32_t block_size, pp_block_pool **out) {
    const int32_t full_attention = 0;
    return pp_pool_create_grouped(num_blocks, block_size, 1, &full_attention, out);
}

int32_t pp_pool_create_grouped(int32_t num_blocks, int32_t block_size, int32_t n_groups,
                               const int32_t *group_window, pp_block_pool **out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_pool_create: out is NULL");
    *out = NULL;
    if (num_blocks < 1) return pp_fail(PP_ERR_INVALID, "num_blocks must be >= 1, got %d", num_blocks);
    if (block_size < 1) return pp_fail(PP_ERR_INVALID, "block_size must be >= 1, got %d", block_size);
    if (n_groups < 1 || n_groups > PP_MAX_GROUPS || !group_window)
        return pp_fail(PP_ERR_INVALID, "a pool needs 1 to %d layer groups and their windows, got %d",
                       PP_MAX_GROUPS, n_groups);
    for (int32_t g = 0; g < n_groups; g++)
        if (group_window[g] < 0)
            return pp_fail(PP_ERR_INVALID, "group %d: window %d is negative", g, group_window[g]);
    if ((int64_t)num_blocks * block_size > INT32_MAX)
        return pp_fail(PP_ERR_INVALID, "num_blocks * block_size overflows the slot index (%d * %d)",
                       num_blocks, block_size);

    pp_block_pool *p = calloc(1, sizeof *p);
    if (!p) return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate the block pool");
    size_t n = (size_t)num_blocks;
    p->num_blocks = num_blocks;
    p->block_size = block_size;
    p->ref_count = calloc(n, sizeof(int32_t));
    p->num_filled = calloc(n, sizeof(int32_t));
    p->state = calloc(n, 1);
    p->has_hash = calloc(n, 1);
    p->computed = calloc(n, 1);
    p->hash = calloc(n, sizeof(uint64_t));
    p->parent_hash = calloc(n, sizeof(uint64_t));
    p->block_tokens = malloc(n * (size_t)block_size * sizeof(int32_t));
    p->free_stack = malloc(n * sizeof(int32_t));
    p->lru_prev = malloc(n * sizeof(int32_t));
    p->lru_next = malloc(n * sizeof(int32_t));
    p->block_group = calloc(n, sizeof(int32_t));
    p->group_window = malloc((size_t)n_groups * sizeof(int32_t));
    if (!p->block_group || !p->group_window || !p->ref_count || !p->num_filled || !p->state || !p->has_hash || !p->computed || !p->hash ||
        !p->parent_hash || !p->block_tokens || !p->free_stack || !p->lru_prev || !p->lru_next ||
        pp_hash_map_init(&p->prefix_map, num_blocks) != PP_OK) {
        pp_pool_destroy(p);
        return pp_fail(PP_ERR_NO_MEMORY, "cannot allocate a pool of %d blocks of %d tokens",
                       num_blocks, block_size);
    }
    /* Stack order makes block 0 the first one handed out. */
    for (int32_t i = 0; i < num_blocks; i++) p->free_stack[i] = num_blocks - 1 - i;
    p->num_free = num_blocks;
    p->lru_head = p->lru_tail = -1;
    p->free_seq_slot = -1;
    p->hash_mask = ~0ull;
    random_key(p->hash_key);
    p->n_groups = n_groups;
    memcpy(p->group_window, group_window, (size_t)n_groups * sizeof(int32_t));
    *out = p;
    return PP_OK;
}

void pp_pool_destroy(pp_block_pool *p) {
    if (!p) return;
    for (int32_t i = 0; i < p->seqs_capacity; i++) {
        free(p->seqs[i].block_table);
        free(p->seqs[i].token_ids);
        free(p->seqs[i].num_released);
    }
    free(p->seqs);
    pp_hash_map_release(&p->prefix_map);
    /* the per-block arrays and the groups' windows, as pp_pool_create_grouped makes them */
    void *arrays[] = {p->ref_count, p->num_filled, p->state, p->has_hash, p->computed, p->hash,
                      p->parent_hash, p->block_tokens, p->free_stack, p->lru_prev, p->lru_next,
                      p->block_group, p->group_window};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) free(arrays[i]);
    free(p);
}

int32_t pp_pool_stats_get(const pp_block_pool *p, pp_pool_stats *out) {
    if (!p || !out) return pp_fail(PP_ERR_INVALID, "pp_pool_stats_get: NULL argument");
    out->num_blocks = p->num_blocks;
    out->block_size = p->block_size;
    out->num_free = p->num_free;
    out->num_cached = p->num_cached;
    out->num_used = p->num_blocks - p->num_free - p->num_cached;
    out->num_shared = p->num_shared;
    out->num_seqs = p->num_seqs;
    out->num_hits = p->num_hits;
    out->num_misses = p->num_misses;
    out->num_evictions = p->num_evictions;
    out->num_cow_copies = p->num_cow_copies;
    out->tokens_stored = p->tokens_stored;
    out->tokens_logical = p->tokens_logical;
    out->slots_held = (int64_t)out->num_used * p->block_size;
    out->n_groups = p->n_groups;
    return PP_OK;
}

int32_t pp_pool_block_info(const pp_block_pool *p, int32_t b, pp_block_info *out) {
    if (!p || !out) return pp_fail(PP_ERR_INVALID, "pp_pool_block_info: NULL argument");
    if (b < 0 || b >= p->num_blocks)
        return pp_fail(PP_ERR_INVALID, "block id %d out of range [0, %d)", b, p->num_blocks);
    out->state = p->state[b];
    out->ref_count = p->ref_count[b];
    out->num_tokens = p->num_filled[b];
    out->has_hash = p->has_hash[b];
    out->is_computed = p->computed[b];
    out->hash = p->hash[b];
    out->group = p->block_group[b];
    return PP_OK;
}

int32_t pp_pool_num_allocatable(const pp_block_pool *p) {
    return p ? p->num_free + p->num_cached : 0;
}

int32_t pp_pool_evict(pp_block_pool *p, int32_t max_blocks, int32_t *num_evicted) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_evict: pool is NULL");
    int32_t n = 0;
    while (n < max_blocks && p->lru_head >= 0) {
        int32_t b = p->lru_head;
        lru_unlink(p, b);
        pp_prefix_forget(p, b);
        make_free(p, b);
        p->num_evictions++;
        n++;
    }
    if (num_evicted) *num_evicted = n;
    return PP_OK;
}

int32_t pp_pool_reset_prefix_cache(pp_block_pool *p) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_reset_prefix_cache: pool is NULL");
    pp_pool_evict(p, p->num_blocks, NULL);
    pp_prefix_forget_all(p);
    return PP_OK;
}
