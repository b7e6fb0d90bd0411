/* A step's batch built from the pool in one call: the flat arrays the
 * forward step takes (tokens, positions, slot mapping and block tables per
 * layer group, sequence index, logit rows), read straight from each
 * sequence's tokens and block tables, into the caller's reused buffers.
 * After the step, one call marks what it computed and gives back the
 * window groups' blocks that fell out of every later query's window. */
#include "pool/block_pool_internal.h"

#include <string.h>

static const pp_sequence *live_seq(const pp_block_pool *p, int32_t seq_id) {
    if (seq_id < 0 || seq_id >= p->seqs_capacity || !p->seqs[seq_id].is_live) return NULL;
    return &p->seqs[seq_id];
}

int32_t pp_pool_build_batch(const pp_block_pool *p, const pp_step_item *items, int32_t n_items,
                            int32_t max_blocks_per_seq, int32_t capacity_tokens, pp_step_buffers *out) {
    if (!p || !out || n_items < 0 || (n_items > 0 && !items) || max_blocks_per_seq < 1 || capacity_tokens < 0)
        return pp_fail(PP_ERR_INVALID, "pp_pool_build_batch: NULL or negative argument");
    /* Check everything first: a malformed item leaves the buffers untouched. */
    int64_t total = 0;
    for (int32_t i = 0; i < n_items; i++) {
        const pp_step_item *it = &items[i];
        const pp_sequence *s = live_seq(p, it->seq_id);
        if (!s) return pp_fail(PP_ERR_INVALID, "step item %d: unknown sequence id %d", i, it->seq_id);
        if (it->count < 1 || it->start < 0 || (int64_t)it->start + it->count > s->num_tokens)
            return pp_fail(PP_ERR_INVALID, "step item %d: tokens [%d, %d) outside sequence %d of %d tokens", i,
                           it->start, it->start + it->count, it->seq_id, s->num_tokens);
        if (s->num_blocks > max_blocks_per_seq)
            return pp_fail(PP_ERR_CAPACITY, "step item %d: %d blocks exceed the %d of a block table row", i,
                           s->num_blocks, max_blocks_per_seq);
        /* Every group holds the blocks the item's queries see (its own and its window's). */
        for (int32_t g = 0; g < p->n_groups; g++)
            if (pp_group_first_needed(p, g, it->start) < s->num_released[g])
                return pp_fail(PP_ERR_INVALID, "step item %d: group %d gave back blocks its queries at %d still see",
                               i, g, it->start);
        total += it->count;
    }
    if (total > capacity_tokens)
        return pp_fail(PP_ERR_CAPACITY, "step of %lld tokens exceeds the buffers' %d", (long long)total,
                       capacity_tokens);
    if (n_items > 0 && (!out->token_ids || !out->positions || !out->slot_mapping || !out->seq_index ||
                        !out->block_tables || !out->logit_rows))
        return pp_fail(PP_ERR_INVALID, "pp_pool_build_batch: a buffer is NULL");
    const int32_t bs = p->block_size;
    const size_t table_stride = (size_t)n_items * max_blocks_per_seq;
    int32_t n = 0, n_logits = 0;
    for (int32_t i = 0; i < n_items; i++) {
        const pp_step_item *it = &items[i];
        const pp_sequence *s = live_seq(p, it->seq_id);
        memcpy(out->token_ids + n, s->token_ids + it->start, sizeof(int32_t) * (size_t)it->count);
        for (int32_t j = 0; j < it->count; j++) {
            out->positions[n + j] = it->start + j;
            out->seq_index[n + j] = i;
        }
        for (int32_t g = 0; g < p->n_groups; g++) {
            const int32_t *table = pp_seq_table(s, g);
            int32_t *slots = out->slot_mapping + (size_t)g * total + n;
            for (int32_t j = 0; j < it->count; j++) {
                const int32_t pos = it->start + j;
                slots[j] = table[pos / bs] * bs + pos % bs;
            }
            int32_t *row = out->block_tables + g * table_stride + (size_t)i * max_blocks_per_seq;
            memcpy(row, table, sizeof(int32_t) * (size_t)s->num_blocks);
            for (int32_t b = s->num_blocks; b < max_blocks_per_seq; b++) row[b] = -1;
        }
        n += it->count;
        if (it->start + it->count == s->num_tokens) out->logit_rows[n_logits++] = n - 1;
    }
    out->n_tokens = n;
    out->n_logits = n_logits;
    out->n_groups = p->n_groups;
    return PP_OK;
}

int32_t pp_pool_commit_batch(pp_block_pool *p, const pp_step_item *items, int32_t n_items) {
    if (!p || n_items < 0 || (n_items > 0 && !items))
        return pp_fail(PP_ERR_INVALID, "pp_pool_commit_batch: NULL or negative argument");
    for (int32_t i = 0; i < n_items; i++) {
        const pp_sequence *s = live_seq(p, items[i].seq_id);
        if (!s || items[i].start < 0 || items[i].count < 0 ||
            (int64_t)items[i].start + items[i].count > s->num_tokens)
            return pp_fail(PP_ERR_INVALID, "step item %d: not a range of a live sequence", i);
    }
    for (int32_t i = 0; i < n_items; i++) {
        pp_sequence *s = &p->seqs[items[i].seq_id];
        const int32_t done = items[i].start + items[i].count;
        for (int32_t g = 0; g < p->n_groups; g++) {
            const int32_t *table = pp_seq_table(s, g);
            for (int32_t b = s->num_released[g]; b < done / p->block_size; b++) p->computed[table[b]] = 1;
        }
        /* The window groups' blocks no later query sees go back to the pool. */
        pp_seq_release_out_of_window(p, s, done);
    }
    return PP_OK;
}
