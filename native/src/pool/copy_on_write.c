/* Copy-on-write: blocks are shared by reference count (forks for n>1
 * samples and beams, prefix-cache hits); a sequence about to write into a
 * shared, partly filled last block first gets its own copy, in every layer
 * group that shares it. The pool only reports (src, dst); the KV bytes are
 * copied by pp_kv_cache_copy_blocks. */
#include "pool/block_pool_internal.h"

#include <string.h>

int pp_cow_needed(const pp_block_pool *p, const pp_sequence *s) {
    /* A full last block is never written again: the next token opens a new one. */
    if (s->num_tokens % p->block_size == 0) return 0;
    int n = 0;
    for (int32_t g = 0; g < p->n_groups; g++) {
        const int32_t b = pp_seq_table(s, g)[s->num_blocks - 1];
        n += b >= 0 && p->ref_count[b] > 1;
    }
    return n;
}

void pp_cow_last_blocks(pp_block_pool *p, pp_sequence *s, pp_block_copy *copies) {
    const int32_t idx = s->num_blocks - 1;
    const size_t bs = (size_t)p->block_size;
    int n = 0;
    for (int32_t g = 0; g < p->n_groups; g++) {
        int32_t *table = pp_seq_table(s, g);
        const int32_t src = table[idx];
        if (src < 0 || p->ref_count[src] <= 1) continue;
        const int32_t dst = pp_block_take(p, g);
        memcpy(&p->block_tokens[(size_t)dst * bs], &p->block_tokens[(size_t)src * bs], bs * sizeof(int32_t));
        p->num_filled[dst] = p->num_filled[src];
        p->tokens_stored += p->num_filled[dst];
        pp_block_ref_dec(p, src);
        table[idx] = dst;
        copies[n].src = src;
        copies[n].dst = dst;
        n++;
        p->num_cow_copies++;
    }
}
