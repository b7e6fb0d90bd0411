/* Sequences and their block tables: each sequence maps its logical blocks
 * to physical ones in the pool. Creating one reuses the prefix cache's hits;
 * appending takes a fresh block at each block boundary (after a
 * copy-on-write of a shared last block); forking shares every block; freeing
 * gives each block's reference back. */
#include "pool/block_pool_internal.h"

#include <stdlib.h>
#include <string.h>

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

/* Grow a sequence's group tables to hold `needed` logical blocks each,
 * moving each group's row to its place in the wider layout. */
static int grow_tables(pp_sequence *s, int32_t n_groups, int64_t needed) {
    if (needed <= s->blocks_capacity) return PP_OK;
    if (needed * n_groups > INT32_MAX) return PP_ERR_NO_MEMORY;
    int64_t cap = s->blocks_capacity ? s->blocks_capacity : 16;
    while (cap < needed) cap *= 2;
    if (cap * n_groups > INT32_MAX) cap = INT32_MAX / n_groups;
    int32_t *grown = malloc((size_t)cap * n_groups * sizeof(int32_t));
    if (!grown) return PP_ERR_NO_MEMORY;
    for (int32_t g = 0; g < n_groups && s->block_table; g++)
        memcpy(grown + (size_t)g * cap, s->block_table + (size_t)g * s->blocks_capacity,
               (size_t)s->num_blocks * sizeof(int32_t));
    free(s->block_table);
    s->block_table = grown;
    s->blocks_capacity = (int32_t)cap;
    return PP_OK;
}

static int reserve_seq_arrays(pp_sequence *s, int64_t num_tokens, int32_t block_size, int32_t n_groups) {
    int64_t num_blocks = (num_tokens + block_size - 1) / block_size;
    if (!s->num_released) s->num_released = calloc((size_t)n_groups, sizeof(int32_t));
    if (!s->num_released || grow_i32(&s->token_ids, &s->tokens_capacity, num_tokens) != PP_OK ||
        grow_tables(s, n_groups, num_blocks) != PP_OK)
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
    s->chain_hash = 0;
    memset(s->num_released, 0, (size_t)p->n_groups * sizeof(int32_t));
    p->num_seqs++;
}

static int32_t blocks_for(int64_t num_tokens, int32_t block_size) {
    return (int32_t)((num_tokens + block_size - 1) / block_size);
}

/* Write tokens into the sequence's blocks, taking a fresh block in every
 * group at each block boundary and hashing each block that becomes full.
 * The caller has checked capacity and reserved the arrays. */
static void write_tokens(pp_block_pool *p, pp_sequence *s, const int32_t *token_ids, int32_t n) {
    const int32_t bs = p->block_size;
    for (int32_t i = 0; i < n; i++) {
        int32_t pos = s->num_tokens;
        int32_t offset = pos % bs;
        if (offset == 0) {
            for (int32_t g = 0; g < p->n_groups; g++) pp_seq_table(s, g)[s->num_blocks] = pp_block_take(p, g);
            s->num_blocks++;
        }
        const int32_t idx = s->num_blocks - 1;
        for (int32_t g = 0; g < p->n_groups; g++) {
            int32_t b = pp_seq_table(s, g)[idx];
            p->block_tokens[(size_t)b * bs + offset] = token_ids[i];
            p->num_filled[b] = offset + 1;
        }
        s->token_ids[s->num_tokens++] = token_ids[i];
        p->tokens_stored += p->n_groups;
        p->tokens_logical++;
        if (offset == bs - 1) {
            const uint64_t h = pp_prefix_chain_hash(p, s->chain_hash, &s->token_ids[(size_t)idx * bs]);
            for (int32_t g = 0; g < p->n_groups; g++) pp_prefix_register(p, pp_seq_table(s, g)[idx], s->chain_hash, h);
            s->chain_hash = h;
        }
    }
}

void pp_seq_release_out_of_window(pp_block_pool *p, pp_sequence *s, int64_t num_computed) {
    for (int32_t g = 0; g < p->n_groups; g++) {
        if (p->group_window[g] <= 0) continue;
        int32_t *table = pp_seq_table(s, g);
        int32_t keep = pp_group_first_needed(p, g, num_computed);
        if (keep > s->num_blocks) keep = s->num_blocks;
        for (int32_t i = s->num_released[g]; i < keep; i++) {
            if (table[i] >= 0) pp_block_ref_dec(p, table[i]);
            table[i] = -1;
        }
        if (keep > s->num_released[g]) s->num_released[g] = keep;
    }
}

/* Place the reusable prefix of token_ids (plan and ids from
 * pp_prefix_plan_lookup) in a newly claimed sequence. */
static void place_hits(pp_block_pool *p, pp_sequence *s, const int32_t *token_ids, int32_t num_tokens,
                       const int32_t *ids, const pp_prefix_plan *plan) {
    const int32_t bs = p->block_size;
    const int32_t max_hit = num_tokens > 0 ? (num_tokens - 1) / bs : 0;
    for (int32_t g = 0; g < p->n_groups; g++) {
        int32_t *table = pp_seq_table(s, g);
        for (int32_t i = 0; i < plan->num_hit; i++) {
            const int32_t b = ids[(size_t)g * max_hit + i];
            table[i] = b;
            if (b >= 0) pp_block_ref_inc(p, b);
        }
        s->num_released[g] = pp_group_first_needed(p, g, (int64_t)plan->num_hit * bs);
    }
    s->num_blocks = plan->num_hit;
    s->num_tokens = plan->num_hit * bs;
    s->chain_hash = plan->chain_hash;
    memcpy(s->token_ids, token_ids, (size_t)s->num_tokens * sizeof(int32_t));
    p->tokens_logical += s->num_tokens;
    p->num_hits += plan->num_reused;
    p->num_misses += plan->num_lookups - plan->num_reused;
}

/* Shared by the pp_seq_create variants: the prefix-cache hits (unless
 * !lookup), then (place_rest) every other token in new blocks. */
static int create_seq(pp_block_pool *p, uint64_t root, const int32_t *token_ids, int32_t num_tokens, int lookup,
                      int place_rest, int32_t *seq_id, int32_t *num_cached_tokens) {
    if (!p || !seq_id) return pp_fail(PP_ERR_INVALID, "pp_seq_create: NULL argument");
    if (num_tokens < 0 || (num_tokens > 0 && !token_ids))
        return pp_fail(PP_ERR_INVALID, "pp_seq_create: invalid token list (%d tokens)", num_tokens);
    const int32_t bs = p->block_size;
    const int32_t max_hit = num_tokens > 0 ? (num_tokens - 1) / bs : 0;

    /* Dry run: how much of the prefix is cached, and what does the rest cost. */
    int32_t *ids = malloc(sizeof(int32_t) * ((size_t)max_hit * p->n_groups + 1));
    if (!ids) return pp_fail(PP_ERR_NO_MEMORY, "cannot plan a sequence of %d tokens", num_tokens);
    pp_prefix_plan plan;
    if (lookup) {
        pp_prefix_plan_lookup(p, root, token_ids, num_tokens, ids, &plan);
    } else {
        memset(&plan, 0, sizeof plan);
        plan.chain_hash = root;
    }
    const int32_t num_new = place_rest ? (blocks_for(num_tokens, bs) - plan.num_hit) * p->n_groups : 0;
    const int32_t available = p->num_free + p->num_cached - plan.num_reused_cached;
    if (num_new > available) {
        free(ids);
        return pp_fail(PP_ERR_OUT_OF_BLOCKS,
                       "out of KV blocks: a sequence of %d tokens needs %d new blocks, %d available",
                       num_tokens, num_new, available);
    }
    int32_t slot;
    int st = reserve_seq_slot(p, &slot);
    if (st == PP_OK) st = reserve_seq_arrays(&p->seqs[slot], num_tokens, bs, p->n_groups);
    if (st != PP_OK) {
        free(ids);
        return st;
    }
    pp_sequence *s = &p->seqs[slot];
    claim_seq_slot(p, slot);
    place_hits(p, s, token_ids, num_tokens, ids, &plan);
    free(ids);
    if (place_rest) write_tokens(p, s, token_ids + s->num_tokens, num_tokens - s->num_tokens);
    *seq_id = slot;
    if (num_cached_tokens) *num_cached_tokens = plan.num_hit * bs;
    return PP_OK;
}

int32_t pp_seq_create(pp_block_pool *p, const int32_t *token_ids, int32_t num_tokens,
                      int32_t *seq_id, int32_t *num_cached_tokens) {
    return create_seq(p, 0, token_ids, num_tokens, 1, 1, seq_id, num_cached_tokens);
}

int32_t pp_seq_create_uncached(pp_block_pool *p, const int32_t *token_ids, int32_t num_tokens, int32_t *seq_id) {
    return create_seq(p, 0, token_ids, num_tokens, 0, 1, seq_id, NULL);
}

int32_t pp_seq_create_cached(pp_block_pool *p, const int32_t *token_ids, int32_t num_tokens,
                             int32_t *seq_id, int32_t *num_cached_tokens) {
    return create_seq(p, 0, token_ids, num_tokens, 1, 0, seq_id, num_cached_tokens);
}

int32_t pp_seq_create_rooted(pp_block_pool *p, uint64_t root, int32_t mode, const int32_t *token_ids,
                             int32_t num_tokens, int32_t *seq_id, int32_t *num_cached_tokens) {
    switch (mode) {
        case PP_SEQ_CREATE: return create_seq(p, root, token_ids, num_tokens, 1, 1, seq_id, num_cached_tokens);
        case PP_SEQ_CREATE_CACHED: return create_seq(p, root, token_ids, num_tokens, 1, 0, seq_id, num_cached_tokens);
        case PP_SEQ_CREATE_UNCACHED:
            if (num_cached_tokens) *num_cached_tokens = 0;
            return create_seq(p, root, token_ids, num_tokens, 0, 1, seq_id, NULL);
        default: return pp_fail(PP_ERR_INVALID, "pp_seq_create_rooted: unknown mode %d", mode);
    }
}

static int32_t append_cost(const pp_block_pool *p, const pp_sequence *s, int32_t n) {
    if (n == 0) return 0;
    int32_t grow = blocks_for((int64_t)s->num_tokens + n, p->block_size) - s->num_blocks;
    return grow * p->n_groups + pp_cow_needed(p, s);
}

int32_t pp_seq_blocks_needed(const pp_block_pool *p, int32_t seq_id, int32_t num_tokens,
                             int32_t *num_blocks) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (num_tokens < 0 || !num_blocks)
        return pp_fail(PP_ERR_INVALID, "pp_seq_blocks_needed: invalid argument");
    *num_blocks = append_cost(p, s, num_tokens);
    return PP_OK;
}

int32_t pp_seq_append(pp_block_pool *p, int32_t seq_id, const int32_t *token_ids,
                      int32_t num_tokens, pp_block_copy *copies, int32_t max_copies,
                      int32_t *num_copies) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (num_tokens < 0 || (num_tokens > 0 && !token_ids))
        return pp_fail(PP_ERR_INVALID, "pp_seq_append: invalid token list (%d tokens)", num_tokens);
    if (num_copies) *num_copies = 0;
    if (num_tokens == 0) return PP_OK;
    int cow = pp_cow_needed(p, s);
    if (cow && (!copies || max_copies < cow || !num_copies))
        return pp_fail(PP_ERR_CAPACITY, "pp_seq_append: %d copy-on-write copies must be reported "
                                        "but room for %d was given", cow, copies ? max_copies : 0);
    int32_t cost = append_cost(p, s, num_tokens);
    int32_t available = p->num_free + p->num_cached;
    if (cost > available)
        return pp_fail(PP_ERR_OUT_OF_BLOCKS,
                       "out of KV blocks: appending %d tokens to sequence %d needs %d blocks, "
                       "%d available", num_tokens, seq_id, cost, available);
    int st = reserve_seq_arrays(s, (int64_t)s->num_tokens + num_tokens, p->block_size, p->n_groups);
    if (st != PP_OK) return st;

    if (cow) {
        pp_cow_last_blocks(p, s, copies);
        *num_copies = cow;
    }
    write_tokens(p, s, token_ids, num_tokens);
    return PP_OK;
}

int32_t pp_seq_append_each(pp_block_pool *p, const int32_t *seq_ids, const int32_t *token_ids, int32_t n,
                           pp_block_copy *copies, int32_t max_copies, int32_t *num_copies) {
    if (!p || n < 0 || (n > 0 && (!seq_ids || !token_ids)) || !num_copies)
        return pp_fail(PP_ERR_INVALID, "pp_seq_append_each: invalid argument (%d sequences)", n);
    *num_copies = 0;
    /* Checked whole before anything changes: each sequence's own cost, summed, is at least
     * the batch's (a block two forks share is copied for the first only). */
    int64_t cost = 0, cow = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!live_seq(p, seq_ids[i])) return pp_fail(PP_ERR_INVALID, "unknown sequence id %d", seq_ids[i]);
        for (int32_t j = 0; j < i; j++)
            if (seq_ids[j] == seq_ids[i])
                return pp_fail(PP_ERR_INVALID, "pp_seq_append_each: sequence %d listed twice", seq_ids[i]);
        const pp_sequence *s = &p->seqs[seq_ids[i]];
        cost += append_cost(p, s, 1);
        cow += pp_cow_needed(p, s);
    }
    if (cow > max_copies || (cow > 0 && !copies))
        return pp_fail(PP_ERR_CAPACITY, "pp_seq_append_each: %lld copy-on-write copies may be reported but room "
                                        "for %d was given", (long long)cow, copies ? max_copies : 0);
    const int32_t available = p->num_free + p->num_cached;
    if (cost > available)
        return pp_fail(PP_ERR_OUT_OF_BLOCKS, "out of KV blocks: one token for each of %d sequences needs up to "
                                             "%lld blocks, %d available", n, (long long)cost, available);
    for (int32_t i = 0; i < n; i++) {
        int st = reserve_seq_arrays(&p->seqs[seq_ids[i]], (int64_t)p->seqs[seq_ids[i]].num_tokens + 1,
                                    p->block_size, p->n_groups);
        if (st != PP_OK) return st;   /* before any token is written: nothing changed */
    }
    for (int32_t i = 0; i < n; i++) {
        pp_sequence *s = &p->seqs[seq_ids[i]];
        const int need = pp_cow_needed(p, s);
        if (need) {
            pp_cow_last_blocks(p, s, copies + *num_copies);
            *num_copies += need;
        }
        write_tokens(p, s, token_ids + i, 1);
    }
    return PP_OK;
}

int32_t pp_seq_fork(pp_block_pool *p, int32_t parent_id, int32_t *child_id) {
    if (!child_id) return pp_fail(PP_ERR_INVALID, "pp_seq_fork: child_id is NULL");
    if (!live_seq(p, parent_id)) return pp_fail(PP_ERR_INVALID, "unknown sequence id %d", parent_id);
    int32_t slot;
    int st = reserve_seq_slot(p, &slot);
    if (st != PP_OK) return st;
    /* reserve_seq_slot may move the table: look the parent up again. */
    pp_sequence *parent = &p->seqs[parent_id];
    pp_sequence *child = &p->seqs[slot];
    st = reserve_seq_arrays(child, parent->num_tokens, p->block_size, p->n_groups);
    if (st != PP_OK) return st;
    claim_seq_slot(p, slot);
    memcpy(child->token_ids, parent->token_ids, (size_t)parent->num_tokens * sizeof(int32_t));
    child->num_tokens = parent->num_tokens;
    child->num_blocks = parent->num_blocks;
    child->chain_hash = parent->chain_hash;
    for (int32_t g = 0; g < p->n_groups; g++) {
        const int32_t *from = pp_seq_table(parent, g);
        int32_t *to = pp_seq_table(child, g);
        memcpy(to, from, (size_t)parent->num_blocks * sizeof(int32_t));
        child->num_released[g] = parent->num_released[g];
        for (int32_t i = 0; i < child->num_blocks; i++)
            if (to[i] >= 0) pp_block_ref_inc(p, to[i]);
    }
    p->tokens_logical += child->num_tokens;
    *child_id = slot;
    return PP_OK;
}

int32_t pp_seq_free(pp_block_pool *p, int32_t seq_id) {
    SEQ_OR_FAIL(s, p, seq_id);
    /* Last blocks first, so they are the first evicted: the shared prefix of
     * a conversation is worth more to later requests than its tail. */
    for (int32_t i = s->num_blocks - 1; i >= 0; i--)
        for (int32_t g = 0; g < p->n_groups; g++)
            if (pp_seq_table(s, g)[i] >= 0) pp_block_ref_dec(p, pp_seq_table(s, g)[i]);
    p->tokens_logical -= s->num_tokens;
    s->is_live = 0;
    s->num_blocks = 0;
    s->num_tokens = 0;
    s->next_free_slot = p->free_seq_slot;
    p->free_seq_slot = seq_id;
    p->num_seqs--;
    return PP_OK;
}

int32_t pp_seq_length(const pp_block_pool *p, int32_t seq_id, int32_t *num_tokens) {
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

int32_t pp_seq_group_block_table(const pp_block_pool *p, int32_t seq_id, int32_t group, int32_t *out,
                                 int32_t capacity, int32_t *num_blocks) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (group < 0 || group >= p->n_groups)
        return pp_fail(PP_ERR_INVALID, "group %d outside the pool's %d", group, p->n_groups);
    return copy_out(pp_seq_table(s, group), s->num_blocks, out, capacity, num_blocks, "pp_seq_group_block_table");
}

int32_t pp_seq_tokens(const pp_block_pool *p, int32_t seq_id, int32_t *out,
                      int32_t capacity, int32_t *num_tokens) {
    SEQ_OR_FAIL(s, p, seq_id);
    return copy_out(s->token_ids, s->num_tokens, out, capacity, num_tokens, "pp_seq_tokens");
}

int32_t pp_seq_slot_mapping(const pp_block_pool *p, int32_t seq_id, int32_t start,
                            int32_t count, int32_t *out) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (start < 0 || count < 0 || (int64_t)start + count > s->num_tokens || (count > 0 && !out))
        return pp_fail(PP_ERR_INVALID, "slot range [%d, %d) outside sequence %d of %d tokens",
                       start, start + count, seq_id, s->num_tokens);
    const int32_t bs = p->block_size;
    for (int32_t i = 0; i < count; i++) {
        int32_t pos = start + i;
        out[i] = s->block_table[pos / bs] * bs + pos % bs;   /* group 0's row */
    }
    return PP_OK;
}

int32_t pp_seq_mark_computed(pp_block_pool *p, int32_t seq_id, int32_t num_tokens) {
    SEQ_OR_FAIL(s, p, seq_id);
    if (num_tokens < 0 || num_tokens > s->num_tokens)
        return pp_fail(PP_ERR_INVALID, "cannot mark %d tokens computed in sequence %d of %d tokens",
                       num_tokens, seq_id, s->num_tokens);
    for (int32_t g = 0; g < p->n_groups; g++) {
        const int32_t *table = pp_seq_table(s, g);
        for (int32_t i = s->num_released[g]; i < num_tokens / p->block_size; i++) p->computed[table[i]] = 1;
    }
    pp_seq_release_out_of_window(p, s, num_tokens);
    return PP_OK;
}
