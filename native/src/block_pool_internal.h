/* The block pool's data, shared by its sources: block_pool.c (blocks and
 * their states), block_table.c (sequences and their block tables),
 * copy_on_write.c and prefix_cache.c. Not part of the contract. */
#ifndef PP_BLOCK_POOL_INTERNAL_H
#define PP_BLOCK_POOL_INTERNAL_H

#include "pyllama_paged.h"
#include "pp_internal.h"

#define PP_HIDDEN __attribute__((visibility("hidden")))

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

/* block_pool.c: block state transitions. */
PP_HIDDEN int32_t pp_block_take(pp_block_pool *p);          /* caller checked one is allocatable */
PP_HIDDEN void    pp_block_ref_inc(pp_block_pool *p, int32_t b);
PP_HIDDEN void    pp_block_ref_dec(pp_block_pool *p, int32_t b);

/* prefix_cache.c: the hash chain over full blocks. */
PP_HIDDEN int     pp_prefix_is_registered(const pp_block_pool *p, int32_t b);
PP_HIDDEN void    pp_prefix_forget(pp_block_pool *p, int32_t b);       /* unregister, clear its hash */
PP_HIDDEN void    pp_prefix_register(pp_block_pool *p, int32_t b, uint64_t parent, const int32_t *tokens);
/* Dry run of a lookup: how many leading full blocks hit (*num_hit_cached of
 * them cached, not used) out of *num_lookups the rule allows. Changes nothing. */
PP_HIDDEN int32_t pp_prefix_count_hits(const pp_block_pool *p, const int32_t *token_ids, int32_t num_tokens,
                                       int32_t *num_hit_cached, int32_t *num_lookups);
/* The block holding tokens after the block hashed *parent, or -1; on a hit
 * *parent becomes its hash (the next lookup's parent). */
PP_HIDDEN int32_t pp_prefix_lookup(const pp_block_pool *p, uint64_t *parent, const int32_t *tokens);

/* copy_on_write.c */
PP_HIDDEN int     pp_cow_needed(const pp_block_pool *p, const pp_sequence *s);
PP_HIDDEN void    pp_cow_last_block(pp_block_pool *p, pp_sequence *s, pp_block_copy *copy);

#endif
