/* The block pool's data, shared by its sources: block_pool.c (blocks and
 * their states), block_table.c (sequences and their block tables),
 * copy_on_write.c and prefix_cache.c. Not part of the contract.
 *
 * Who calls whom: block_table.c calls the pool, copy-on-write and the prefix
 * cache; the pool owns every block state change, eviction included, and
 * consults the prefix cache (a map from hashes to blocks) without being
 * called back by it. */
#ifndef PP_BLOCK_POOL_INTERNAL_H
#define PP_BLOCK_POOL_INTERNAL_H

#include "pyllama_paged.h"
#include "common/pp_internal.h"
#include "pool/hash_map.h"

#include <stddef.h>

/* A sequence's block tables, one per layer group: group g's physical block
 * for logical block i is block_table[g * blocks_capacity + i]. Every group
 * holds the same logical blocks, except that a sliding-window group gives
 * back its leading blocks once no future query can see them: those entries
 * are -1 and num_released[g] counts them. */
typedef struct pp_sequence {
    int32_t *block_table;
    int32_t  num_blocks;       /* logical blocks, the same in every group */
    int32_t  blocks_capacity;  /* row length of each group's table */
    int32_t *num_released;     /* per group: leading blocks given back */
    uint64_t chain_hash;       /* hash of the sequence's last full block (0: none yet) */
    int32_t *token_ids;
    int32_t  num_tokens;
    int32_t  tokens_capacity;
    int32_t  is_live;
    int32_t  next_free_slot;   /* free list of sequence slots */
} pp_sequence;

struct pp_block_pool {
    int32_t num_blocks;
    int32_t block_size;
    int32_t n_groups;          /* layer groups sharing the pool (1 without sliding windows) */
    int32_t *group_window;     /* per group: 0 = full attention, else the window in tokens */
    int32_t *block_group;      /* per block: the group whose table it was taken for */

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
    uint64_t hash_key[2];      /* the block hash's secret key: random per pool */

    int32_t num_shared;
    int64_t num_hits, num_misses, num_evictions, num_cow_copies;
    int64_t tokens_stored, tokens_logical;
};

#define PP_MAX_GROUPS 256

/* Group g's table row of sequence s. */
static inline int32_t *pp_seq_table(const pp_sequence *s, int32_t g) {
    return s->block_table + (size_t)g * s->blocks_capacity;
}

/* The first logical block of group g that a query at position >= num_computed
 * can still see: 0 for full attention, else the block holding the first key of
 * that query's window (keys k with pos - k < window are visible). */
static inline int32_t pp_group_first_needed(const pp_block_pool *p, int32_t g, int64_t num_computed) {
    const int64_t w = p->group_window[g];
    if (w <= 0 || num_computed - w + 1 <= 0) return 0;
    return (int32_t)((num_computed - w + 1) / p->block_size);
}

/* block_pool.c: block state transitions. */
PP_HIDDEN int32_t pp_block_take(pp_block_pool *p, int32_t group);   /* caller checked one is allocatable */
PP_HIDDEN void    pp_block_ref_inc(pp_block_pool *p, int32_t b);
PP_HIDDEN void    pp_block_ref_dec(pp_block_pool *p, int32_t b);

/* prefix_cache.c: the hash chain over full blocks. */
PP_HIDDEN int     pp_prefix_is_registered(const pp_block_pool *p, int32_t b);
PP_HIDDEN void    pp_prefix_forget(pp_block_pool *p, int32_t b);       /* unregister, clear its hash */
/* Unregister every block at once; blocks still in use keep their hashes but
 * are found no more, and are freed, not cached, when released. */
PP_HIDDEN void    pp_prefix_forget_all(pp_block_pool *p);
/* The chained hash of the full block of tokens after the block hashed parent
 * (the same in every group; narrowed when a test weakens the hash). */
PP_HIDDEN uint64_t pp_prefix_chain_hash(const pp_block_pool *p, uint64_t parent, const int32_t *tokens);
/* Register block b (of its group) as holding the full block hashed h after parent. */
PP_HIDDEN void    pp_prefix_register(pp_block_pool *p, int32_t b, uint64_t parent, uint64_t h);

/* What a new sequence of these tokens can reuse from the prefix cache. */
typedef struct pp_prefix_plan {
    int32_t  num_hit;          /* H: leading logical blocks whose KV every group has */
    int32_t  num_lookups;      /* full blocks looked up, over all groups (the hit-rate base) */
    int32_t  num_reused;       /* blocks reused, over all groups */
    int32_t  num_reused_cached;/* of those, blocks now cached (ref 0): they leave the allocatable count */
    uint64_t chain_hash;       /* hash of logical block H - 1 (the chain's root if H == 0) */
} pp_prefix_plan;

/* Dry run of a lookup: fills *plan and ids[g * max_hit + i] (max_hit =
 * (num_tokens - 1) / block_size) with group g's block for logical block i,
 * -1 where the group does not need it (before its window) or missed. A hit
 * of H blocks needs, in every full-attention group, blocks [0, H) and in each
 * window group only the blocks the query at position H * block_size sees.
 * Changes nothing. */
PP_HIDDEN void    pp_prefix_plan_lookup(const pp_block_pool *p, uint64_t root, const int32_t *token_ids, int32_t num_tokens,
                                        int32_t *ids, pp_prefix_plan *plan);

/* copy_on_write.c */
/* Groups whose partly filled last block is shared and must be copied before a write. */
PP_HIDDEN int     pp_cow_needed(const pp_block_pool *p, const pp_sequence *s);
/* Copy every such last block; writes pp_cow_needed(s) pairs to copies. */
PP_HIDDEN void    pp_cow_last_blocks(pp_block_pool *p, pp_sequence *s, pp_block_copy *copies);

/* block_table.c: give back window groups' blocks no query at position
 * >= num_computed can see. */
PP_HIDDEN void    pp_seq_release_out_of_window(pp_block_pool *p, pp_sequence *s, int64_t num_computed);

#endif
