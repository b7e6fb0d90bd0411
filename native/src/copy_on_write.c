/* Copy-on-write: blocks are shared by reference count (forks for n>1
 * samples and beams, prefix-cache hits); a sequence about to write into a
 * shared, partly filled last block first gets its own copy. The pool only
 * reports (src, dst); the KV bytes are copied by pp_kv_cache_copy_blocks. */
#include "block_pool_internal.h"

#include <string.h>

int pp_cow_needed(const pp_block_pool *p, const pp_sequence *s) {
    /* A full last block is never written again: the next token opens a new one. */
    if (s->num_tokens % p->block_size == 0) return 0;
    return p->ref_count[s->block_table[s->num_blocks - 1]] > 1;
}

void pp_cow_last_block(pp_block_pool *p, pp_sequence *s, pp_block_copy *copy) {
    const int32_t idx = s->num_blocks - 1;
    const int32_t src = s->block_table[idx];
    const int32_t dst = pp_block_take(p);
    const size_t bs = (size_t)p->block_size;
    memcpy(&p->block_tokens[(size_t)dst * bs], &p->block_tokens[(size_t)src * bs], bs * sizeof(int32_t));
    p->num_filled[dst] = p->num_filled[src];
    p->tokens_stored += p->num_filled[dst];
    pp_block_ref_dec(p, src);
    s->block_table[idx] = dst;
    copy->src = src;
    copy->dst = dst;
    p->num_cow_copies++;
}
