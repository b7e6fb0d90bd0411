/* The block pool: physical KV blocks, per-sequence block tables, reference
 * counts, copy-on-write and the hash-chained prefix cache with LRU eviction.
 * It knows nothing of models or tensors: blocks are ints, tokens are ints. */
#include "pyllama_paged.h"
#include "pp_internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct pp_sequence {
    int32_t *block_table;
    int32_t  num_blocks;
    int32_t  blocks_capacity;
    int32_t *token_ids;
    int32_t  num_tokens;
    int32_t  tokens_capacity;
    int32_t  is_live;
    int32_t  next_free_slot;   /* free list of sequence slots */
} pp_sequence;

struct pp_block_pool {
    int32_t num_blocks;
    int32_t block_size;

    int32_t  *ref_count;
    int32_t  *num_filled;      /* token slots written in each block */
    uint8_t  *state;           /* enum pp_block_state */
    uint8_t  *has_hash;
    uint8_t  *computed;        /* KV of the block's tokens has been written */
    uint64_t *hash;
    uint64_t *parent_hash;     /* hash of the block before it when it was hashed (0: first) */
    int32_t  *block_tokens;    /* num_blocks * block_size token ids, for hit checks */

    int32_t *free_stack;       /* PP_BLOCK_FREE blocks, LIFO */
    int32_t  num_free;

    /* PP_BLOCK_CACHED blocks in a doubly linked list, oldest use first. */
    int32_t *lru_prev;
    int32_t *lru_next;
    int32_t  lru_head;
    int32_t  lru_tail;
    int32_t  num_cached;

    pp_hash_map prefix_map;    /* registered hash -> block id */

    pp_sequence *seqs;
    int32_t      seqs_capacity;
    int32_t      free_seq_slot;
    int32_t      num_seqs;

    uint64_t hash_mask;        /* all ones, unless a test weakens the hash */

    int32_t num_shared;
    int64_t num_hits, num_misses, num_evictions, num_cow_copies;
    int64_t tokens_stored, tokens_logical;
};

/* ---- hashing ------------------------------------------------------------ */

static uint64_t mix64(uint64_t x) {
    /* A strong 64-bit finalizer: every input bit affects every output bit. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

uint64_t pp_hash_block(uint64_t parent_hash, const int32_t *token_ids, int32_t num_tokens) {
    uint64_t h = mix64(parent_hash ^ 0x9e3779b97f4a7c15ull);
    for (int32_t i = 0; i < num_tokens; i++) {
        h = mix64(h ^ (uint64_t)(uint32_t)token_ids[i]) + 0x9e3779b97f4a7c15ull;
    }
    /* Zero is the "no parent" value; keep real hashes away from it. */
    return h ? h : 1;
}

/* The pool's chained hash of one full block: pp_hash_block, narrowed only
 * when a test asks for collisions. */
static uint64_t chain_hash(const pp_block_pool *p, uint64_t parent, const int32_t *token_ids) {
    uint64_t h = pp_hash_block(parent, token_ids, p->block_size) & p->hash_mask;
    return h ? h : 1;
}

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

static int is_registered(const pp_block_pool *p, int32_t b) {
    return p->has_hash[b] && pp_hash_map_get(&p->prefix_map, p->hash[b]) == b;
}

/* Caller has checked that a block is allocatable. Prefers never-cached free
 * blocks so cached prefixes survive as long as possible. */
static int32_t take_block(pp_block_pool *p) {
    int32_t b;
    if (p->num_free > 0) {
        b = p->free_stack[--p->num_free];
    } else {
        b = p->lru_head;
        lru_unlink(p, b);
        pp_hash_map_remove(&p->prefix_map, p->hash[b]);
        p->has_hash[b] = 0;
        p->hash[b] = 0;
        p->parent_hash[b] = 0;
        p->num_filled[b] = 0;
        p->num_evictions++;
    }
    p->computed[b] = 0;
    p->state[b] = PP_BLOCK_USED;
    p->ref_count[b] = 1;
    return b;
}

static void ref_inc(pp_block_pool *p, int32_t b) {
    if (p->state[b] == PP_BLOCK_CACHED) {
        lru_unlink(p, b);
        p->state[b] = PP_BLOCK_USED;
        p->tokens_stored += p->num_filled[b];
    }
    if (++p->ref_count[b] == 2) p->num_shared++;
}

static void ref_dec(pp_block_pool *p, int32_t b) {
    int32_t r = --p->ref_count[b];
    if (r == 1) p->num_shared--;
    if (r > 0) return;
    p->tokens_stored -= p->num_filled[b];
    if (is_registered(p, b) && p->computed[b]) {
        p->state[b] = PP_BLOCK_CACHED;
        lru_push_newest(p, b);
        return;
    }
    /* A block whose KV was never written must not be found by a later lookup. */
    if (is_registered(p, b)) pp_hash_map_remove(&p->prefix_map, p->hash[b]);
    make_free(p, b);
}

/* ---- pool --------------------------------------------------------------- */

int pp_pool_create(int32_t num_blocks, int32_t block_size, pp_block_pool **out) {
    if (!out) return pp_fail(PP_ERR_INVALID, "pp_pool_create: out is NULL");
    *out = NULL;
    if (num_blocks < 1) return pp_fail(PP_ERR_INVALID, "num_blocks must be >= 1, got %d", num_blocks);
    if (block_size < 1) return pp_fail(PP_ERR_INVALID, "block_size must be >= 1, got %d", block_size);
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
    if (!p->ref_count || !p->num_filled || !p->state || !p->has_hash || !p->computed || !p->hash ||
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
    *out = p;
    return PP_OK;
}

void pp_pool_destroy(pp_block_pool *p) {
    if (!p) return;
    for (int32_t i = 0; i < p->seqs_capacity; i++) {
        free(p->seqs[i].block_table);
        free(p->seqs[i].token_ids);
    }
    free(p->seqs);
    pp_hash_map_release(&p->prefix_map);
    free(p->ref_count);
    free(p->num_filled);
    free(p->state);
    free(p->has_hash);
    free(p->computed);
    free(p->hash);
    free(p->parent_hash);
    free(p->block_tokens);
    free(p->free_stack);
    free(p->lru_prev);
    free(p->lru_next);
    free(p);
}

int pp_pool_stats_get(const pp_block_pool *p, pp_pool_stats *out) {
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
    return PP_OK;
}

int pp_pool_block_info(const pp_block_pool *p, int32_t b, pp_block_info *out) {
    if (!p || !out) return pp_fail(PP_ERR_INVALID, "pp_pool_block_info: NULL argument");
    if (b < 0 || b >= p->num_blocks)
        return pp_fail(PP_ERR_INVALID, "block id %d out of range [0, %d)", b, p->num_blocks);
    out->state = p->state[b];
    out->ref_count = p->ref_count[b];
    out->num_tokens = p->num_filled[b];
    out->has_hash = p->has_hash[b];
    out->is_computed = p->computed[b];
    out->hash = p->hash[b];
    return PP_OK;
}

int32_t pp_pool_num_allocatable(const pp_block_pool *p) {
    return p ? p->num_free + p->num_cached : 0;
}

int pp_pool_evict(pp_block_pool *p, int32_t max_blocks, int32_t *num_evicted) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_evict: pool is NULL");
    int32_t n = 0;
    while (n < max_blocks && p->lru_head >= 0) {
        int32_t b = p->lru_head;
        lru_unlink(p, b);
        pp_hash_map_remove(&p->prefix_map, p->hash[b]);
        make_free(p, b);
        p->num_evictions++;
        n++;
    }
    if (num_evicted) *num_evicted = n;
    return PP_OK;
}

int pp_pool_weaken_hash(pp_block_pool *p, int32_t bits) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_weaken_hash: pool is NULL");
    if (bits < 1 || bits > 64) return pp_fail(PP_ERR_INVALID, "hash bits must be in [1, 64], got %d", bits);
    if (p->num_seqs > 0 || p->num_cached > 0)
        return pp_fail(PP_ERR_INVALID, "the hash can only change while the pool is empty");
    p->hash_mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    return PP_OK;
}

int pp_pool_reset_prefix_cache(pp_block_pool *p) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_reset_prefix_cache: pool is NULL");
    pp_pool_evict(p, p->num_blocks, NULL);
    pp_hash_map_clear(&p->prefix_map);
    return PP_OK;
}

/* ---- sequences ---------------------------------------------------------- */

static pp_sequence *live_seq(const pp_block_pool *p, int32_t seq_id) {
    if (!p || seq_id < 0 || seq_id >= p->seqs_capacity || !p->seqs[seq_id].is_live) return NULL;
    return &p->seqs[seq_id];
}

#define SEQ_OR_FAIL(seq, p, id)                                                      \
    pp_sequence *seq = live_seq((p), (id));                                          \
    if (!seq) return pp_fail(PP_ERR_INVALID, "unknown sequence id %d", (int)(id))

static int grow_i32(int32_t **arr, int32_t *capacity, int64_t needed) {
    if (needed <= *capacity) return PP_OK;
    if (needed > INT32_MAX) return PP_ERR_NO_MEMORY;
    int64_t cap = *capacity ? *capacity : 16;
    while (cap < needed) cap *= 2;
    if (cap > INT32_MAX) cap = INT32_MAX;
    int32_t *grown = realloc(*arr, (size_t)cap * sizeof(int32_t));
    if (!grown) return PP_ERR_NO_MEMORY;
    *arr = grown;
    *capacity = (int32_t)cap;
    return PP_OK;
}

/* Make room for a sequence with the given sizes before any pool state
 * changes, so the caller can fail without undoing anything. */
static int reserve_seq_slot(pp_block_pool *p, int32_t *slot) {
    if (p->free_seq_slot < 0) {
        int32_t old = p->seqs_capacity;
        int32_t cap = old ? old * 2 : 16;
        pp_sequence *grown = realloc(p->seqs, (size_t)cap * sizeof *grown);
        if (!grown) return pp_fail(PP_ERR_NO_MEMORY, "cannot grow the sequence table");
        memset(grown + old, 0, (size_t)(cap - old) * sizeof *grown);
        for (int32_t i = cap - 1; i >= old; i--) {
            grown[i].next_free_slot = p->free_seq_slot;
            p->free_seq_slot = i;
        }
        p->seqs = grown;
        p->seqs_capacity = cap;
    }
    *slot = p->free_seq_slot;
    return PP_OK;
}

static int reserve_seq_arrays(pp_sequence *s, int64_t num_tokens, int32_t block_size) {
    int64_t num_blocks = (num_tokens + block_size - 1) / block_size;
    if (grow_i32(&s->token_ids, &s->tokens_capacity, num_tokens) != PP_OK ||
        grow_i32(&s->block_table, &s->blocks_capacity, num_blocks) != PP_OK)
        return pp_fail(PP_ERR_NO_MEMORY, "cannot grow a sequence to %lld tokens",
                       (long long)num_tokens);
    return PP_OK;
}

static void claim_seq_slot(pp_block_pool *p, int32_t slot) {
    pp_sequence *s = &p->seqs[slot];
    p->free_seq_slot = s->next_free_slot;
    s->is_live = 1;
    s->num_blocks = 0;
    s->num_tokens = 0;
    p->num_seqs++;
}

static int32_t blocks_for(int64_t num_tokens, int32_t block_size) {
    return (int32_t)((num_tokens + block_size - 1) / block_size);
}

/* Write tokens into the sequence's blocks, taking a fresh block at each
 * block boundary and hashing each block that becomes full. The caller has
 * checked capacity and reserved the arrays. */
static void write_tokens(pp_block_pool *p, pp_sequence *s, const int32_t *token_ids, int32_t n) {
    const int32_t bs = p->block_size;
    for (int32_t i = 0; i < n; i++) {
        int32_t pos = s->num_tokens;
        int32_t offset = pos % bs;
        if (offset == 0) s->block_table[s->num_blocks++] = take_block(p);
        int32_t b = s->block_table[s->num_blocks - 1];
        p->block_tokens[(size_t)b * bs + offset] = token_ids[i];
        p->num_filled[b] = offset + 1;
        s->token_ids[s->num_tokens++] = token_ids[i];
        p->tokens_stored++;
        p->tokens_logical++;
        if (offset == bs - 1) {
            int32_t idx = s->num_blocks - 1;
            uint64_t parent = idx > 0 ? p->hash[s->block_table[idx - 1]] : 0;
            uint64_t h = chain_hash(p, parent, &s->token_ids[(size_t)idx * bs]);
            p->hash[b] = h;
            p->parent_hash[b] = parent;
            p->has_hash[b] = 1;
            /* A duplicate of an already registered block keeps its hash (so
             * the chain continues) but the map keeps pointing at the first. */
            if (pp_hash_map_get(&p->prefix_map, h) < 0) pp_hash_map_put(&p->prefix_map, h, b);
        }
    }
}

/* The registered, computed block holding exactly these bs tokens after a
 * block hashed to parent, or -1. Blocks still waiting for their KV are never
 * reused. Comparing the tokens and the parent's hash (not only the block's
 * own hash) makes a hit exact by induction over the chain: a collision of
 * the chained hash cannot attach these tokens to another prefix's KV. */
static int32_t lookup_block(const pp_block_pool *p, uint64_t h, uint64_t parent, const int32_t *token_ids) {
    int32_t b = pp_hash_map_get(&p->prefix_map, h);
    if (b < 0 || !p->computed[b] || p->parent_hash[b] != parent) return -1;
    if (memcmp(&p->block_tokens[(size_t)b * p->block_size], token_ids,
               (size_t)p->block_size * sizeof(int32_t)) != 0)
        return -1;
    return b;
}

int pp_seq_create(pp_block_pool *p, const int32_t *token_ids, int32_t num_tokens,
                  int32_t *seq_id, int32_t *num_cached_tokens) {
    if (!p || !seq_id) return pp_fail(PP_ERR_INVALID, "pp_seq_create: NULL argument");
    if (num_tokens < 0 || (num_tokens > 0 && !token_ids))
        return pp_fail(PP_ERR_INVALID, "pp_seq_create: invalid token list (%d tokens)", num_tokens);
    const int32_t bs = p->block_size;
    /* The last token is always computed again (its logits start generation),
     * and a cached block is immutable: hits stop before the block holding it. */
    const int32_t max_hit = num_tokens > 0 ? (num_tokens - 1) / bs : 0;

    /* Dry run: how much of the prefix is cached, and what does the rest cost. */
    int32_t num_hit = 0, num_hit_cached = 0;
    uint64_t parent = 0;
    for (; num_hit < max_hit; num_hit++) {
        const int32_t *chunk = token_ids + (size_t)num_hit * bs;
        uint64_t h = chain_hash(p, parent, chunk);
        int32_t b = lookup_block(p, h, parent, chunk);
        if (b < 0) break;
        if (p->state[b] == PP_BLOCK_CACHED) num_hit_cached++;
        parent = h;
    }
    int32_t num_new = blocks_for(num_tokens, bs) - num_hit;
    int32_t available = p->num_free + p->num_cached - num_hit_cached;
    if (num_new > available)
        return pp_fail(PP_ERR_OUT_OF_BLOCKS,
                       "out of KV blocks: a sequence of %d tokens needs %d new blocks, %d available",
                       num_tokens, num_new, available);

    int32_t slot;
    int st = reserve_seq_slot(p, &slot);
    if (st != PP_OK) return st;
    pp_sequence *s = &p->seqs[slot];
    st = reserve_seq_arrays(s, num_tokens, bs);
    if (st != PP_OK) return st;

    claim_seq_slot(p, slot);
    parent = 0;
    for (int32_t i = 0; i < num_hit; i++) {
        const int32_t *chunk = token_ids + (size_t)i * bs;
        uint64_t h = chain_hash(p, parent, chunk);
        int32_t b = lookup_block(p, h, parent, chunk);
        ref_inc(p, b);
        s->block_table[s->num_blocks++] = b;
        memcpy(&s->token_ids[s->num_tokens], chunk, (size_t)bs * sizeof(int32_t));
        s->num_tokens += bs;
        p->tokens_logical += bs;
        parent = h;
    }
    p->num_hits += num_hit;
    p->num_misses += max_hit - num_hit;
    write_tokens(p, s, token_ids + (size_t)num_hit * bs, num_tokens - num_hit * bs);
    *seq_id = slot;
    if (num_cached_tokens) *num_cached_tokens = num_hit * bs;
    return PP_OK;
}

/* Whether appending to s must first copy its last block (shared, not full). */
static int needs_cow(const pp_block_pool *p, const pp_sequence *s) {
    if (s->num_tokens % p->block_size == 0) return 0;
    return p->ref_count[s->block_table[s->num_blocks - 1]] > 1;
}

static int32_t append_cost(const pp_block_pool *p, const pp_sequence *s, int32_t n) {
    if (n == 0) return 0;
    int32_t grow = blocks_for((int64_t)s->num_tokens + n, p->block_size) - s->num_blocks;
    return grow + needs_cow(p, s);
}

int pp_seq_blocks_needed(const pp_block_pool *p, int32_t seq_id, int32_t num_tokens,
                         int32_t *num_blocks) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (num_tokens < 0 || !num_blocks)
        return pp_fail(PP_ERR_INVALID, "pp_seq_blocks_needed: invalid argument");
    *num_blocks = append_cost(p, s, num_tokens);
    return PP_OK;
}

int pp_seq_append(pp_block_pool *p, int32_t seq_id, const int32_t *token_ids,
                  int32_t num_tokens, pp_block_copy *copies, int32_t max_copies,
                  int32_t *num_copies) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (num_tokens < 0 || (num_tokens > 0 && !token_ids))
        return pp_fail(PP_ERR_INVALID, "pp_seq_append: invalid token list (%d tokens)", num_tokens);
    if (num_copies) *num_copies = 0;
    if (num_tokens == 0) return PP_OK;
    int cow = needs_cow(p, s);
    if (cow && (!copies || max_copies < 1 || !num_copies))
        return pp_fail(PP_ERR_CAPACITY, "pp_seq_append: a copy-on-write must be reported "
                                        "but no room for it was given");
    int32_t cost = append_cost(p, s, num_tokens);
    int32_t available = p->num_free + p->num_cached;
    if (cost > available)
        return pp_fail(PP_ERR_OUT_OF_BLOCKS,
                       "out of KV blocks: appending %d tokens to sequence %d needs %d blocks, "
                       "%d available", num_tokens, seq_id, cost, available);
    int st = reserve_seq_arrays(s, (int64_t)s->num_tokens + num_tokens, p->block_size);
    if (st != PP_OK) return st;

    if (cow) {
        int32_t idx = s->num_blocks - 1;
        int32_t src = s->block_table[idx];
        int32_t dst = take_block(p);
        size_t bs = (size_t)p->block_size;
        memcpy(&p->block_tokens[(size_t)dst * bs], &p->block_tokens[(size_t)src * bs],
               bs * sizeof(int32_t));
        p->num_filled[dst] = p->num_filled[src];
        p->tokens_stored += p->num_filled[dst];
        ref_dec(p, src);
        s->block_table[idx] = dst;
        copies[0].src = src;
        copies[0].dst = dst;
        *num_copies = 1;
        p->num_cow_copies++;
    }
    write_tokens(p, s, token_ids, num_tokens);
    return PP_OK;
}

int pp_seq_fork(pp_block_pool *p, int32_t parent_id, int32_t *child_id) {
    if (!child_id) return pp_fail(PP_ERR_INVALID, "pp_seq_fork: child_id is NULL");
    if (!live_seq(p, parent_id)) return pp_fail(PP_ERR_INVALID, "unknown sequence id %d", parent_id);
    int32_t slot;
    int st = reserve_seq_slot(p, &slot);
    if (st != PP_OK) return st;
    /* reserve_seq_slot may move the table: look the parent up again. */
    pp_sequence *parent = &p->seqs[parent_id];
    pp_sequence *child = &p->seqs[slot];
    st = reserve_seq_arrays(child, parent->num_tokens, p->block_size);
    if (st != PP_OK) return st;
    claim_seq_slot(p, slot);
    memcpy(child->token_ids, parent->token_ids, (size_t)parent->num_tokens * sizeof(int32_t));
    memcpy(child->block_table, parent->block_table, (size_t)parent->num_blocks * sizeof(int32_t));
    child->num_tokens = parent->num_tokens;
    child->num_blocks = parent->num_blocks;
    for (int32_t i = 0; i < child->num_blocks; i++) ref_inc(p, child->block_table[i]);
    p->tokens_logical += child->num_tokens;
    *child_id = slot;
    return PP_OK;
}

int pp_seq_free(pp_block_pool *p, int32_t seq_id) {
    SEQ_OR_FAIL(s, p, seq_id);
    /* Last blocks first, so they are the first evicted: the shared prefix of
     * a conversation is worth more to later requests than its tail. */
    for (int32_t i = s->num_blocks - 1; i >= 0; i--) ref_dec(p, s->block_table[i]);
    p->tokens_logical -= s->num_tokens;
    s->is_live = 0;
    s->num_blocks = 0;
    s->num_tokens = 0;
    s->next_free_slot = p->free_seq_slot;
    p->free_seq_slot = seq_id;
    p->num_seqs--;
    return PP_OK;
}

int pp_seq_length(const pp_block_pool *p, int32_t seq_id, int32_t *num_tokens) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (!num_tokens) return pp_fail(PP_ERR_INVALID, "pp_seq_length: num_tokens is NULL");
    *num_tokens = s->num_tokens;
    return PP_OK;
}

static int copy_out(const int32_t *src, int32_t n, int32_t *out, int32_t capacity,
                    int32_t *num_out, const char *what) {
    if (!num_out) return pp_fail(PP_ERR_INVALID, "%s: count pointer is NULL", what);
    *num_out = n;
    if (capacity < n || (n > 0 && !out))
        return pp_fail(PP_ERR_CAPACITY, "%s: need room for %d entries, got %d", what, n, capacity);
    if (n > 0) memcpy(out, src, (size_t)n * sizeof(int32_t));
    return PP_OK;
}

int pp_seq_block_table(const pp_block_pool *p, int32_t seq_id, int32_t *out,
                       int32_t capacity, int32_t *num_blocks) {
    SEQ_OR_FAIL(s, p, seq_id);
    return copy_out(s->block_table, s->num_blocks, out, capacity, num_blocks, "pp_seq_block_table");
}

int pp_seq_tokens(const pp_block_pool *p, int32_t seq_id, int32_t *out,
                  int32_t capacity, int32_t *num_tokens) {
    SEQ_OR_FAIL(s, p, seq_id);
    return copy_out(s->token_ids, s->num_tokens, out, capacity, num_tokens, "pp_seq_tokens");
}

int pp_seq_slot_mapping(const pp_block_pool *p, int32_t seq_id, int32_t start,
                        int32_t count, int32_t *out) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (start < 0 || count < 0 || (int64_t)start + count > s->num_tokens || (count > 0 && !out))
        return pp_fail(PP_ERR_INVALID, "slot range [%d, %d) outside sequence %d of %d tokens",
                       start, start + count, seq_id, s->num_tokens);
    const int32_t bs = p->block_size;
    for (int32_t i = 0; i < count; i++) {
        int32_t pos = start + i;
        out[i] = s->block_table[pos / bs] * bs + pos % bs;
    }
    return PP_OK;
}

int pp_seq_mark_computed(pp_block_pool *p, int32_t seq_id, int32_t num_tokens) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (num_tokens < 0 || num_tokens > s->num_tokens)
        return pp_fail(PP_ERR_INVALID, "cannot mark %d tokens computed in sequence %d of %d tokens",
                       num_tokens, seq_id, s->num_tokens);
    for (int32_t i = 0; i < num_tokens / p->block_size; i++) p->computed[s->block_table[i]] = 1;
    return PP_OK;
}
