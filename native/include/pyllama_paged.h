/*
 * pyllama_paged.h: the whole C contract of pyllama-paged's native core.
 *
 * Python binds this header with cffi (ABI mode), so it must stay plain C:
 * no macros inside declarations, no C++ types, fixed-width integers only.
 *
 * Conventions for every function below:
 *   - The return value is a status (PP_OK = 0, otherwise a PP_ERR_* code).
 *   - On failure, pp_last_error() returns a message that says what went wrong;
 *     the message is per thread and lives until that thread's next failing call.
 *   - A failing call changes nothing: no half-done allocation is left behind.
 *   - Pointers passed in are borrowed for the duration of the call only.
 *   - Output arrays are written by the callee and owned by the caller.
 *   - A pool is not thread safe: callers serialize access to one pool
 *     (the Python scheduler owns it from one thread).
 */
#ifndef PYLLAMA_PAGED_H
#define PYLLAMA_PAGED_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ------------------------------------------------------ */

enum pp_status {
    PP_OK                 = 0,
    PP_ERR_INVALID        = 1,  /* bad argument: unknown id, negative size, ... */
    PP_ERR_OUT_OF_BLOCKS  = 2,  /* the pool cannot satisfy the request right now */
    PP_ERR_NO_MEMORY      = 3,  /* the host allocator failed */
    PP_ERR_CAPACITY       = 4   /* an output array passed in is too small */
};

/* The calling thread's last error message. Never NULL; "" if none.
 * The string is owned by the library. */
const char *pp_last_error(void);

/* The library's version string, owned by the library. */
const char *pp_version(void);

/* ---- block pool -------------------------------------------------------- */

/* Opaque pool of num_blocks physical KV blocks of block_size tokens each,
 * with the block tables of every sequence that lives in it. */
typedef struct pp_block_pool pp_block_pool;

/* Block states: every block is exactly one of these. */
enum pp_block_state {
    PP_BLOCK_FREE   = 0,  /* ref_count 0, no hash: allocatable */
    PP_BLOCK_USED   = 1,  /* ref_count > 0: in some block table */
    PP_BLOCK_CACHED = 2   /* ref_count 0, registered hash: reusable or evictable */
};

/* One copy the KV data must perform because of copy-on-write: the contents
 * of physical block src must be copied into block dst before dst is written. */
typedef struct pp_block_copy {
    int32_t src;
    int32_t dst;
} pp_block_copy;

typedef struct pp_pool_stats {
    int32_t num_blocks;
    int32_t block_size;
    int32_t num_free;          /* PP_BLOCK_FREE */
    int32_t num_used;          /* PP_BLOCK_USED */
    int32_t num_cached;        /* PP_BLOCK_CACHED (evictable) */
    int32_t num_shared;        /* used blocks with ref_count > 1 */
    int32_t num_seqs;          /* live sequences */
    int64_t num_hits;          /* full blocks found in the prefix cache */
    int64_t num_misses;        /* full blocks looked up and not found */
    int64_t num_evictions;     /* cached blocks reclaimed for new data */
    int64_t num_cow_copies;    /* copy-on-write copies reported */
    int64_t tokens_stored;     /* distinct token slots filled in used blocks */
    int64_t tokens_logical;    /* sum of the lengths of all sequences */
    int64_t slots_held;        /* num_used * block_size */
} pp_pool_stats;

typedef struct pp_block_info {
    int32_t state;             /* enum pp_block_state */
    int32_t ref_count;
    int32_t num_tokens;        /* filled token slots, 0..block_size */
    int32_t has_hash;          /* 1 if the block is full and hashed */
    uint64_t hash;             /* hash of (parent block's hash, token ids) */
} pp_block_info;

/* Create a pool. On success *out owns the pool; free it with
 * pp_pool_destroy. Fails with PP_ERR_INVALID for num_blocks < 1 or
 * block_size < 1, PP_ERR_NO_MEMORY if the host cannot hold it. */
int pp_pool_create(int32_t num_blocks, int32_t block_size, pp_block_pool **out);

/* Destroy a pool and every sequence in it. NULL is accepted. */
void pp_pool_destroy(pp_block_pool *pool);

/* Fill *out with the pool's counters. Never fails for a valid pool. */
int pp_pool_stats_get(const pp_block_pool *pool, pp_pool_stats *out);

/* Fill *out with the state of one physical block (PP_ERR_INVALID if the
 * id is out of range). */
int pp_pool_block_info(const pp_block_pool *pool, int32_t block_id, pp_block_info *out);

/* Number of blocks an allocation could take now: free plus evictable cached. */
int32_t pp_pool_num_allocatable(const pp_block_pool *pool);

/* Evict up to max_blocks cached blocks, least recently used first, turning
 * them into free blocks; *num_evicted (may be NULL) gets how many. */
int pp_pool_evict(pp_block_pool *pool, int32_t max_blocks, int32_t *num_evicted);

/* Forget every prefix-cache entry (cached blocks become free). Used blocks
 * keep their data but will not be found by later lookups. */
int pp_pool_reset_prefix_cache(pp_block_pool *pool);

/* Hash of a full block's token ids chained to its parent's hash (0 for the
 * first block). Pure function; exposed so callers and tests can check the
 * chain. Returns the hash (cannot fail). */
uint64_t pp_hash_block(uint64_t parent_hash, const int32_t *token_ids, int32_t num_tokens);

/* ---- sequences --------------------------------------------------------- */

/* Create a sequence holding token_ids[0..num_tokens). Its longest prefix of
 * full blocks found in the prefix cache is reused (ref++, counted as hits);
 * the rest is written to new blocks. *seq_id gets the new sequence's id and
 * *num_cached_tokens (may be NULL) the number of leading tokens whose KV is
 * already in the reused blocks. PP_ERR_OUT_OF_BLOCKS if the pool is short;
 * then nothing changes (hit/miss counters included). */
int pp_seq_create(pp_block_pool *pool, const int32_t *token_ids, int32_t num_tokens,
                  int32_t *seq_id, int32_t *num_cached_tokens);

/* Append num_tokens tokens to a sequence. A block is allocated only when
 * the last one is full. If the last block is shared (ref_count > 1) it is
 * first copied to a fresh block (copy-on-write) and the (src, dst) pair is
 * written to copies[*num_copies]; at most one copy per call.
 * PP_ERR_OUT_OF_BLOCKS if the pool is short; then nothing changes. */
int pp_seq_append(pp_block_pool *pool, int32_t seq_id, const int32_t *token_ids,
                  int32_t num_tokens, pp_block_copy *copies, int32_t max_copies,
                  int32_t *num_copies);

/* Number of blocks pp_seq_append would take for num_tokens more tokens
 * (including a copy-on-write block). */
int pp_seq_blocks_needed(const pp_block_pool *pool, int32_t seq_id, int32_t num_tokens,
                         int32_t *num_blocks);

/* Fork: the new sequence *child_id shares every block of parent_id (ref++). */
int pp_seq_fork(pp_block_pool *pool, int32_t parent_id, int32_t *child_id);

/* Free a sequence: ref-- on each of its blocks. A block whose count drops to
 * zero becomes cached if it holds a registered hash, otherwise free. */
int pp_seq_free(pp_block_pool *pool, int32_t seq_id);

/* Length in tokens of a sequence. */
int pp_seq_length(const pp_block_pool *pool, int32_t seq_id, int32_t *num_tokens);

/* Copy a sequence's block table (physical block ids, logical order) into
 * out[0..capacity); *num_blocks gets its length. PP_ERR_CAPACITY if
 * capacity is too small (then *num_blocks still tells the size needed). */
int pp_seq_block_table(const pp_block_pool *pool, int32_t seq_id, int32_t *out,
                       int32_t capacity, int32_t *num_blocks);

/* Copy a sequence's token ids into out[0..capacity), like pp_seq_block_table. */
int pp_seq_tokens(const pp_block_pool *pool, int32_t seq_id, int32_t *out,
                  int32_t capacity, int32_t *num_tokens);

/* Slot (block_id * block_size + offset) of positions [start, start + count)
 * of a sequence, written to out[0..count). */
int pp_seq_slot_mapping(const pp_block_pool *pool, int32_t seq_id, int32_t start,
                        int32_t count, int32_t *out);

#ifdef __cplusplus
}
#endif

#endif /* PYLLAMA_PAGED_H */
