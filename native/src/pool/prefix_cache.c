/* The prefix cache: full blocks are hashed in a chain (each hash covers the
 * block's tokens and its parent's hash) and registered in a map, so a later
 * sequence with the same prefix reuses their KV. A hit compares the tokens and
 * the parent's hash, so it is exact by induction; cached blocks (ref count 0)
 * stay until the pool's LRU evicts them (block_pool.c), which then tells the
 * map to forget them: nothing here changes a block's state. */
#include "pool/block_pool_internal.h"
#include "pyllama_paged_testing.h"   /* pp_pool_weaken_hash */

#include <string.h>

static uint64_t mix64(uint64_t x) {
    /* A strong 64-bit finalizer: every input bit affects every output bit. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* The block hash is SipHash-2-4 keyed with the pool's secret key. An unkeyed
 * chain of invertible mixes let anyone compute a second prefix with the same
 * chain hash as a shared system prompt, register a block after it, and have
 * later users' prompts reuse that block's KV (computed after the attacker's
 * prefix). With a secret key per pool, collisions cannot be aimed. */
typedef struct sip_state { uint64_t v0, v1, v2, v3; } sip_state;

static inline uint64_t rotl64(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

static inline void sip_round(sip_state *s) {
    s->v0 += s->v1; s->v1 = rotl64(s->v1, 13); s->v1 ^= s->v0; s->v0 = rotl64(s->v0, 32);
    s->v2 += s->v3; s->v3 = rotl64(s->v3, 16); s->v3 ^= s->v2;
    s->v0 += s->v3; s->v3 = rotl64(s->v3, 21); s->v3 ^= s->v0;
    s->v2 += s->v1; s->v1 = rotl64(s->v1, 17); s->v1 ^= s->v2; s->v2 = rotl64(s->v2, 32);
}

static inline void sip_word(sip_state *s, uint64_t m) {
    s->v3 ^= m;
    sip_round(s);
    sip_round(s);
    s->v0 ^= m;
}

uint64_t pp_hash_block(const pp_block_pool *pool, uint64_t parent_hash, const int32_t *token_ids,
                       int32_t num_tokens) {
    const uint64_t k0 = pool ? pool->hash_key[0] : 0, k1 = pool ? pool->hash_key[1] : 0;
    sip_state s = {k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull,
                   k0 ^ 0x6c7967656e657261ull, k1 ^ 0x7465646279746573ull};
    /* The message: the parent's hash, then the tokens two to a word; the last
     * word carries the message length in bytes in its top byte, as SipHash's does. */
    sip_word(&s, parent_hash);
    int32_t i = 0;
    for (; i + 1 < num_tokens; i += 2)
        sip_word(&s, (uint64_t)(uint32_t)token_ids[i] | (uint64_t)(uint32_t)token_ids[i + 1] << 32);
    uint64_t last = (uint64_t)((8 + 4 * (uint64_t)num_tokens) & 0xff) << 56;
    if (i < num_tokens) last |= (uint64_t)(uint32_t)token_ids[i];
    sip_word(&s, last);
    s.v2 ^= 0xff;
    for (int r = 0; r < 4; r++) sip_round(&s);
    const uint64_t h = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
    /* Zero is the "no parent" value; keep real hashes away from it. */
    return h ? h : 1;
}

/* The pool's chained hash of one full block: pp_hash_block, narrowed only
 * when a test asks for collisions. */
uint64_t pp_prefix_chain_hash(const pp_block_pool *p, uint64_t parent, const int32_t *token_ids) {
    uint64_t h = pp_hash_block(p, parent, token_ids, p->block_size) & p->hash_mask;
    return h ? h : 1;
}

/* The map key of group g's block with chain hash h: the groups hold the same
 * token chain in different blocks (their own layers' KV), so each group has
 * its own entry. Group 0 keeps the plain hash. */
static uint64_t group_key(uint64_t h, int32_t g) {
    return g == 0 ? h : mix64(h + 0x9e3779b97f4a7c15ull * (uint64_t)g);
}

int pp_prefix_is_registered(const pp_block_pool *p, int32_t b) {
    return p->has_hash[b] && pp_hash_map_get(&p->prefix_map, group_key(p->hash[b], p->block_group[b])) == b;
}

void pp_prefix_forget(pp_block_pool *p, int32_t b) {
    if (pp_prefix_is_registered(p, b)) pp_hash_map_remove(&p->prefix_map, group_key(p->hash[b], p->block_group[b]));
    p->has_hash[b] = 0;
    p->hash[b] = 0;
    p->parent_hash[b] = 0;
}

void pp_prefix_forget_all(pp_block_pool *p) {
    pp_hash_map_clear(&p->prefix_map);
}

void pp_prefix_register(pp_block_pool *p, int32_t b, uint64_t parent, uint64_t h) {
    p->hash[b] = h;
    p->parent_hash[b] = parent;
    p->has_hash[b] = 1;
    /* A duplicate of an already registered block keeps its hash (so the
     * chain continues) but the map keeps pointing at the first. */
    const uint64_t key = group_key(h, p->block_group[b]);
    if (pp_hash_map_get(&p->prefix_map, key) < 0) pp_hash_map_put(&p->prefix_map, key, b);
}

/* Group g's registered, computed block holding exactly these bs tokens after
 * a block hashed to parent, or -1. Blocks still waiting for their KV are
 * never reused. Comparing the tokens and the parent's hash (not only the
 * block's own hash) makes a hit exact by induction over the chain: a
 * collision of the chained hash cannot attach these tokens to another
 * prefix's KV. */
static int32_t lookup_block(const pp_block_pool *p, int32_t g, uint64_t h, uint64_t parent,
                            const int32_t *token_ids) {
    int32_t b = pp_hash_map_get(&p->prefix_map, group_key(h, g));
    if (b < 0 || p->block_group[b] != g || !p->computed[b] || p->parent_hash[b] != parent || p->hash[b] != h)
        return -1;
    if (memcmp(&p->block_tokens[(size_t)b * p->block_size], token_ids,
               (size_t)p->block_size * sizeof(int32_t)) != 0)
        return -1;
    return b;
}

void pp_prefix_plan_lookup(const pp_block_pool *p, uint64_t root, const int32_t *token_ids, int32_t num_tokens,
                           int32_t *ids, pp_prefix_plan *plan) {
    /* The last token is always computed again (its logits start generation),
     * and a cached block is immutable: hits stop before the block holding it. */
    const int32_t max_hit = num_tokens > 0 ? (num_tokens - 1) / p->block_size : 0;
    const int32_t bs = p->block_size;
    memset(plan, 0, sizeof *plan);
    /* Full-attention groups need an unbroken chain from the first block; the
     * chain of hashes is walked once and every group looked up along it. A
     * window group's misses are remembered: H is valid for it only if no
     * miss lies inside the window of the query at H * block_size. */
    int32_t full_limit = max_hit;   /* first miss over the full-attention groups */
    int32_t last_miss[PP_MAX_GROUPS];
    for (int32_t g = 0; g < p->n_groups; g++) last_miss[g] = -1;
    /* root: the parent of the first block (0, or the KV identity a sequence is computed under) */
    uint64_t parent = root, chain_at_best = root;
    int32_t best = 0;
    for (int32_t i = 0; i < max_hit && i < full_limit; i++) {
        const int32_t *chunk = token_ids + (size_t)i * bs;
        const uint64_t h = pp_prefix_chain_hash(p, parent, chunk);
        for (int32_t g = 0; g < p->n_groups; g++) {
            const int32_t b = lookup_block(p, g, h, parent, chunk);
            ids[(size_t)g * max_hit + i] = b;
            if (b >= 0) continue;
            if (p->group_window[g] > 0) last_miss[g] = i;
            else if (full_limit > i) full_limit = i;
        }
        parent = h;
        if (i >= full_limit) break;
        /* H = i + 1 is valid if every window group hit all of its window. */
        int ok = 1;
        for (int32_t g = 0; g < p->n_groups && ok; g++)
            if (p->group_window[g] > 0 && last_miss[g] >= pp_group_first_needed(p, g, (int64_t)(i + 1) * bs))
                ok = 0;
        if (ok) {
            best = i + 1;
            chain_at_best = h;
        }
    }
    plan->num_hit = best;
    plan->chain_hash = chain_at_best;
    for (int32_t g = 0; g < p->n_groups; g++) {
        const int32_t lo = pp_group_first_needed(p, g, (int64_t)best * bs);
        plan->num_lookups += max_hit - pp_group_first_needed(p, g, (int64_t)max_hit * bs);
        for (int32_t i = 0; i < max_hit; i++) {
            int32_t *id = &ids[(size_t)g * max_hit + i];
            if (i < lo || i >= best) {
                *id = -1;
                continue;
            }
            plan->num_reused++;
            if (p->state[*id] == PP_BLOCK_CACHED) plan->num_reused_cached++;
        }
    }
}

int32_t pp_pool_set_hash_key(pp_block_pool *p, uint64_t k0, uint64_t k1) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_set_hash_key: pool is NULL");
    if (p->num_seqs > 0 || p->num_cached > 0)
        return pp_fail(PP_ERR_INVALID, "the hash key can only change while the pool is empty");
    p->hash_key[0] = k0;
    p->hash_key[1] = k1;
    return PP_OK;
}

int32_t pp_pool_weaken_hash(pp_block_pool *p, int32_t bits) {
    if (!p) return pp_fail(PP_ERR_INVALID, "pp_pool_weaken_hash: pool is NULL");
    if (bits < 1 || bits > 64) return pp_fail(PP_ERR_INVALID, "hash bits must be in [1, 64], got %d", bits);
    if (p->num_seqs > 0 || p->num_cached > 0)
        return pp_fail(PP_ERR_INVALID, "the hash can only change while the pool is empty");
    p->hash_mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    return PP_OK;
}

