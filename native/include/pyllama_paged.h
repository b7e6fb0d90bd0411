/*
 * pyllama_paged.h: the whole C contract of pyllama-paged's native core.
 *
 * Python binds this header with cffi (ABI mode), so it must stay plain C:
 * no macros inside declarations, no C++ types, fixed-width integers only.
 *
 * Conventions for every function below:
 *   - A function that can fail returns an int32_t status (enum pp_status):
 *     PP_OK = 0; a positive code is a condition the caller may recover from
 *     and retry; a negative code is an error. The few functions that return
 *     something else (a count, a hash, a handle's property) say so.
 *   - On failure, pp_last_error() returns a message that says what went wrong;
 *     the message is per thread and lives until that thread's next failing call.
 *   - A failing call changes nothing: no half-done allocation is left behind
 *     (the few exceptions say what they leave).
 *   - Unless a function says otherwise: a NULL handle or required pointer,
 *     an unknown sequence or block id, or an out-of-range size fails with
 *     PP_ERR_INVALID; a failed host allocation with PP_ERR_NO_MEMORY.
 *   - Pointers passed in are borrowed for the duration of the call only.
 *   - Output arrays are written by the callee and owned by the caller.
 *   - A handle made by pp_X_create is owned by the caller and freed with
 *     pp_X_destroy, which accepts NULL; handles it borrowed must outlive it.
 *   - A pool is not thread safe: callers serialize access to one pool
 *     (the Python scheduler owns it from one thread).
 *
 * Functions only tests and benchmarks need live in pyllama_paged_testing.h;
 * the same library exports them.
 */
#ifndef PYLLAMA_PAGED_H
#define PYLLAMA_PAGED_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ------------------------------------------------------ */

/* Split by sign, as llama.h's are:
 *   0         PP_OK: done.
 *   positive  recoverable: nothing changed, and the same call can succeed
 *             once the caller frees something (blocks) or gives a bigger
 *             output buffer (the size needed is reported where the function
 *             says so). `status > 0` means "retry after making room".
 *   negative  an error the caller must handle (a bad argument, the host out
 *             of memory, a failed or aborted computation); making room will
 *             not fix it.
 * A status is returned as int32_t; compare it with these names, never with
 * literal numbers. */
enum pp_status {
    PP_OK                 = 0,
    PP_ERR_OUT_OF_BLOCKS  = 1,  /* the pool cannot satisfy the request right now: free or
                                   preempt sequences (or evict cached blocks) and retry */
    PP_ERR_CAPACITY       = 2,  /* an output array passed in is too small: retry with a
                                   bigger one */
    PP_ERR_INVALID        = -1, /* bad argument: unknown id, negative size, ... */
    PP_ERR_NO_MEMORY      = -2, /* the host allocator failed */
    PP_ERR_COMPUTE        = -3  /* a computation started and failed or was aborted: the
                                   KV rows of that step's slots are undefined */
};

/* The calling thread's last error message. Never NULL; "" if none.
 * The string is owned by the library. */
const char *pp_last_error(void);

/* The library's version string ("MAJOR.MINOR.PATCH", the Python package's
 * __version__ it was built with), owned by the library; never NULL. The
 * Python binding refuses to load a library whose version differs from the
 * package's (a stale build). */
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
    int32_t n_groups;          /* layer groups sharing the pool (see pp_pool_create_grouped) */
} pp_pool_stats;

typedef struct pp_block_info {
    int32_t state;             /* enum pp_block_state */
    int32_t ref_count;
    int32_t num_tokens;        /* filled token slots, 0..block_size */
    int32_t has_hash;          /* 1 if the block is full and hashed */
    int32_t is_computed;       /* 1 once marked computed (its KV is written) */
    uint64_t hash;             /* hash of (parent block's hash, token ids) */
    int32_t group;             /* layer group the block was last taken for */
} pp_block_info;

/* Create a pool. On success *out owns the pool; free it with
 * pp_pool_destroy. Fails with PP_ERR_INVALID for num_blocks < 1 or
 * block_size < 1, PP_ERR_NO_MEMORY if the host cannot hold it. */
int32_t pp_pool_create(int32_t num_blocks, int32_t block_size, pp_block_pool **out);

/* A pool shared by n_groups layer groups (1..256): every sequence has one
 * block table per group over the same logical blocks, all drawing physical
 * blocks from this pool (a physical block holds one group's layers). Group
 * g attends over the last group_window[g] tokens (0: all of them); once a
 * sequence's computed tokens move past a window, that group's blocks no
 * later query can see go back to the pool (see pp_pool_commit_batch) and
 * its table holds -1 there. Prefix-cache hits are per group: a window group
 * needs only the blocks in the window of the first token computed again.
 * group_window is copied. pp_pool_create is this with one group, window 0.
 * PP_ERR_INVALID for a bad count or a negative window. */
int32_t pp_pool_create_grouped(int32_t num_blocks, int32_t block_size, int32_t n_groups,
                               const int32_t *group_window, pp_block_pool **out);

/* Destroy a pool and every sequence in it. NULL is accepted. */
void pp_pool_destroy(pp_block_pool *pool);

/* Fill *out with the pool's counters. Never fails for a valid pool and out
 * (PP_ERR_INVALID for NULL). */
int32_t pp_pool_stats_get(const pp_block_pool *pool, pp_pool_stats *out);

/* Fill *out with the state of one physical block (PP_ERR_INVALID if the
 * id is out of range). */
int32_t pp_pool_block_info(const pp_block_pool *pool, int32_t block_id, pp_block_info *out);

/* Number of blocks an allocation could take now: free plus evictable cached.
 * A count, not a status: cannot fail (0 for a NULL pool). */
int32_t pp_pool_num_allocatable(const pp_block_pool *pool);

/* Evict up to max_blocks cached blocks, least recently used first, turning
 * them into free blocks; *num_evicted (may be NULL) gets how many. */
int32_t pp_pool_evict(pp_block_pool *pool, int32_t max_blocks, int32_t *num_evicted);

/* Forget every prefix-cache entry (cached blocks become free). Used blocks
 * keep their data but will not be found by later lookups. */
int32_t pp_pool_reset_prefix_cache(pp_block_pool *pool);

/* The pool's hash of a full block's token ids chained to its parent's hash
 * (0 for the first block): SipHash-2-4 under the pool's secret key, which is
 * random per pool, so nobody outside the process can construct a prefix whose
 * chain collides with another user's. Exposed so callers and tests can check
 * the chain. Returns the hash, never 0 (cannot fail; a NULL pool hashes with
 * the all-zero key). */
uint64_t pp_hash_block(const pp_block_pool *pool, uint64_t parent_hash, const int32_t *token_ids,
                       int32_t num_tokens);

/* Set the pool's hash key (random at creation), e.g. so processes that share
 * block hashes agree. PP_ERR_INVALID unless the pool holds no sequence and no
 * cached block. */
int32_t pp_pool_set_hash_key(pp_block_pool *pool, uint64_t k0, uint64_t k1);

/* ---- sequences --------------------------------------------------------- */

/* Create a sequence holding token_ids[0..num_tokens). Its longest prefix of
 * full, computed blocks found in the prefix cache is reused (ref++, counted as hits);
 * the rest is written to new blocks. A hit must match the block's tokens and
 * its parent's hash. Hits never include the block holding the last token:
 * that token is computed again, and cached blocks are never written, so
 * *num_cached_tokens <= num_tokens - 1. *seq_id gets the new sequence's id and
 * *num_cached_tokens (may be NULL) the number of leading tokens whose KV is
 * already in the reused blocks. PP_ERR_OUT_OF_BLOCKS if the pool is short;
 * then nothing changes (hit/miss counters included). */
int32_t pp_seq_create(pp_block_pool *pool, const int32_t *token_ids, int32_t num_tokens,
                      int32_t *seq_id, int32_t *num_cached_tokens);

/* Like pp_seq_create, but the new sequence holds only the reused prefix
 * (*num_cached_tokens tokens, possibly none): the caller appends the rest
 * chunk by chunk as it is computed, so a long prompt never holds every
 * window group's blocks for all of its tokens at once. Takes no new block. */
int32_t pp_seq_create_cached(pp_block_pool *pool, const int32_t *token_ids, int32_t num_tokens,
                             int32_t *seq_id, int32_t *num_cached_tokens);

/* Like pp_seq_create without looking up the prefix cache: every token gets
 * a new block in every group (for recomputing a whole prompt, e.g. its
 * per-position log-probabilities, when window groups keep no early blocks). */
int32_t pp_seq_create_uncached(pp_block_pool *pool, const int32_t *token_ids, int32_t num_tokens,
                               int32_t *seq_id);

/* Append num_tokens tokens to a sequence. A block (one per group) is
 * allocated only when the last one is full. If the last block of a group is
 * shared (ref_count > 1) it is first copied to a fresh block (copy-on-write)
 * and the (src, dst) pair is written to copies[0..*num_copies); at most one
 * copy per group per call (PP_ERR_CAPACITY if max_copies is short).
 * PP_ERR_OUT_OF_BLOCKS if the pool is short; then nothing changes. */
int32_t pp_seq_append(pp_block_pool *pool, int32_t seq_id, const int32_t *token_ids,
                      int32_t num_tokens, pp_block_copy *copies, int32_t max_copies,
                      int32_t *num_copies);

/* One token for each of n distinct sequences (a decode step's placements),
 * all or none: token_ids[i] goes to seq_ids[i], as pp_seq_append would put
 * it, and the copy-on-write pairs of all of them go to copies[0..*num_copies).
 * Checked before anything changes: PP_ERR_INVALID for an unknown or repeated
 * id, PP_ERR_CAPACITY if max_copies may be short, PP_ERR_OUT_OF_BLOCKS if
 * the pool may be short (the sum of each sequence's own cost, which can
 * exceed the batch's when forks share a block: append one by one then). */
int32_t pp_seq_append_each(pp_block_pool *pool, const int32_t *seq_ids, const int32_t *token_ids, int32_t n,
                           pp_block_copy *copies, int32_t max_copies, int32_t *num_copies);

/* Number of blocks pp_seq_append would take for num_tokens more tokens
 * (including a copy-on-write block). */
int32_t pp_seq_blocks_needed(const pp_block_pool *pool, int32_t seq_id, int32_t num_tokens,
                             int32_t *num_blocks);

/* Record that the KV of a sequence's first num_tokens tokens is written:
 * its full blocks in that range become reusable by prefix lookups (blocks
 * never marked are not cached when freed), and window groups give back the
 * blocks no query at position >= num_tokens can see. */
int32_t pp_seq_mark_computed(pp_block_pool *pool, int32_t seq_id, int32_t num_tokens);

/* Fork: the new sequence *child_id shares every block of parent_id (ref++).
 * Takes no block (copy-on-write happens at the next append). */
int32_t pp_seq_fork(pp_block_pool *pool, int32_t parent_id, int32_t *child_id);

/* Free a sequence: ref-- on each of its blocks. A block whose count drops to
 * zero becomes cached if it holds a registered hash, otherwise free. */
int32_t pp_seq_free(pp_block_pool *pool, int32_t seq_id);

/* Length in tokens of a sequence, into *num_tokens. */
int32_t pp_seq_length(const pp_block_pool *pool, int32_t seq_id, int32_t *num_tokens);

/* Copy a sequence's block table in layer group `group` (physical block ids,
 * logical order; -1 where a window group gave a block back) into
 * out[0..capacity); *num_blocks gets its length. PP_ERR_CAPACITY if
 * capacity is too small: nothing is copied, but *num_blocks still tells the
 * size needed (so out may be NULL with capacity 0 to ask for it).
 * PP_ERR_INVALID for an unknown sequence or group, or a NULL num_blocks. */
int32_t pp_seq_group_block_table(const pp_block_pool *pool, int32_t seq_id, int32_t group, int32_t *out,
                                 int32_t capacity, int32_t *num_blocks);

/* Copy a sequence's token ids into out[0..capacity); *num_tokens gets their
 * count. PP_ERR_CAPACITY (and PP_ERR_INVALID) as pp_seq_group_block_table. */
int32_t pp_seq_tokens(const pp_block_pool *pool, int32_t seq_id, int32_t *out,
                      int32_t capacity, int32_t *num_tokens);

/* Slot (block_id * block_size + offset, group 0) of positions [start, start + count)
 * of a sequence, written to out[0..count). */
int32_t pp_seq_slot_mapping(const pp_block_pool *pool, int32_t seq_id, int32_t start,
                            int32_t count, int32_t *out);

/* How pp_seq_create_rooted places a sequence's tokens: as pp_seq_create,
 * pp_seq_create_cached or pp_seq_create_uncached. */
enum pp_seq_create_mode {
    PP_SEQ_CREATE          = 0,
    PP_SEQ_CREATE_CACHED   = 1,
    PP_SEQ_CREATE_UNCACHED = 2
};

/* The pp_seq_create variant `mode` names, with the sequence's hash chain
 * starting from root instead of 0: root is the parent hash of its first
 * block, so its full blocks are hits only for sequences created under the
 * same root, and it never reuses blocks hashed under another (what computes
 * the KV besides the tokens: a LoRA adapter and its scale). Forks keep their
 * parent's chain. root 0 is the plain functions' chain. *num_cached_tokens
 * (may be NULL) as theirs (0 for PP_SEQ_CREATE_UNCACHED). PP_ERR_INVALID for
 * an unknown mode; otherwise as the function the mode names. */
int32_t pp_seq_create_rooted(pp_block_pool *pool, uint64_t root, int32_t mode, const int32_t *token_ids,
                             int32_t num_tokens, int32_t *seq_id, int32_t *num_cached_tokens);

/* ---- a step's batch ---------------------------------------------------- */

/* Tokens [start, start + count) of a sequence, computed in one step. */
typedef struct pp_step_item {
    int32_t seq_id;
    int32_t start;
    int32_t count;
} pp_step_item;

/* The caller's buffers a step's batch is built into (borrowed, reused across
 * steps): token_ids, positions and seq_index hold capacity tokens,
 * slot_mapping n_groups x capacity, block_tables n_groups x n_items rows of
 * max_blocks_per_seq, logit_rows n_items (n_groups: the pool's). n_tokens,
 * n_logits and n_groups are outputs; the layout is pp_batch's. */
typedef struct pp_step_buffers {
    int32_t *token_ids;
    int32_t *positions;
    int32_t *slot_mapping;
    int32_t *seq_index;
    int32_t *block_tables;
    int32_t *logit_rows;
    int32_t  n_tokens;
    int32_t  n_logits;
    int32_t  n_groups;
} pp_step_buffers;

/* Build the flat batch of pp_context_decode for the items, in order: each
 * item's tokens (from the pool), positions, slots (per group), its index as
 * seq_index, its block tables as row i of each group (unused entries -1),
 * and its last token's row in logit_rows when the item reaches its
 * sequence's end. Everything is checked before anything is written:
 * PP_ERR_INVALID for an unknown sequence, a range outside it, or a window
 * group that gave back a block the item's queries see; PP_ERR_CAPACITY when
 * the tokens exceed capacity_tokens or a block table exceeds
 * max_blocks_per_seq. */
int32_t pp_pool_build_batch(const pp_block_pool *pool, const pp_step_item *items, int32_t n_items,
                            int32_t max_blocks_per_seq, int32_t capacity_tokens, pp_step_buffers *out);

/* After a step computed the items: pp_seq_mark_computed(start + count) for
 * each, in one call, which also gives back every window group's blocks that
 * no query at or after start + count can see. PP_ERR_INVALID (nothing
 * marked) for a bad item. */
int32_t pp_pool_commit_batch(pp_block_pool *pool, const pp_step_item *items, int32_t n_items);

/* ---- model -------------------------------------------------------------- */

/* Architectures the graph builder knows. */
enum pp_arch {
    PP_ARCH_LLAMA  = 0,   /* Llama 2/3, Mistral, TinyLlama, SmolLM */
    PP_ARCH_QWEN2  = 1,   /* q/k/v biases */
    PP_ARCH_QWEN3  = 2,   /* per-head q/k RMS norm */
    PP_ARCH_GEMMA3 = 3,   /* q/k norm, post norms, sliding-window layers, GELU, scaled embeddings */
    PP_ARCH_BERT   = 4,   /* encoder only (pp_encoder_*): learned positions, token types, layer norm
                             with bias, GELU, bidirectional attention; no KV cache */
    PP_ARCH_QWEN3MOE = 5, /* qwen3's attention; routed experts (softmax, top n_expert_used,
                             renormalised) instead of the dense FFN */
    PP_ARCH_GPT_OSS  = 6, /* gpt-oss: q/k/v/o biases, a sink logit per head, sliding-window
                             layers (layer_window), YaRN rope; routed experts with biases (top
                             n_expert_used router logits + bias, softmaxed among themselves)
                             and a clamped SwiGLU; post_attention_norm is the FFN's norm */
    PP_ARCH_QWEN35   = 7, /* Qwen3.5/3.6 hybrid: Gated DeltaNet layers (layer_recurrent; their
                             state lives in a pp_state_pool) and full-attention layers with a
                             sigmoid output gate (attn_q holds query and gate per head), q/k
                             norms and IMRoPE (rope_sections); post_attention_norm is the FFN's
                             norm; a dense SwiGLU FFN */
    PP_ARCH_QWEN35MOE = 8, /* qwen35's layers with qwen3moe's routed experts plus a shared expert
                             (n_ff_shexp) scaled by sigmoid(ffn_gate_inp_shexp . x) */
    PP_ARCH_GEMMA4   = 9  /* Gemma 4: gemma3's layer with per-layer head sizes, KV heads and
                             rope (layer_* below; rope_freqs on full layers only), an unweighted
                             v norm (k standing in for a missing v), attention scale 1,
                             shared-KV layers, per-layer embeddings (n_embd_per_layer), a
                             per-layer output scale; with experts (n_expert > 0) a router with
                             its scale and GELU experts beside the dense FFN */
};

/* Hyper-parameters, read from the GGUF metadata by the caller. */
typedef struct pp_model_hparams {
    int32_t arch;                /* enum pp_arch */
    int32_t n_layer;
    int32_t n_embd;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;            /* key (and value) head size */
    int32_t n_ff;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t rope_type;           /* 0 = NORMAL (adjacent pairs), 2 = NEOX (halves) */
    float   rope_freq_base;      /* global-attention layers */
    float   rope_freq_scale;     /* 1 / linear scaling factor */
    float   rope_freq_base_swa;  /* sliding-window layers */
    float   rms_eps;             /* bert: the layer-norm epsilon */
    float   attn_scale;          /* multiplies q.k before softmax */
    float   embd_scale;          /* multiplies token embeddings (1 unless gemma) */
    float   final_logit_softcap; /* 0 = none */
    const int32_t *layer_window; /* n_layer entries: 0 = full attention, else window in tokens;
                                    copied at pp_model_create */
    int32_t n_rot;               /* rotated dims of each head (rope.dimension_count), even,
                                    <= head_dim; 0 = head_dim */
    int32_t n_token_types;       /* bert: rows of token_types.weight; 0 = 2 */
    int32_t n_expert;            /* routed experts per layer (mixture-of-experts archs; 0 = dense) */
    int32_t n_expert_used;       /* experts each token runs, 1..n_expert */
    int32_t n_ff_exp;            /* each expert's feed-forward width */
    float   rope_freq_scale_swa; /* sliding-window layers' 1 / scaling factor; 0 = 1 (unscaled) */
    /* YaRN rope scaling (GGML's ggml_rope_ext arguments), on every layer whose freq scale is
     * not 1: ext_factor 0 = none (plain or linear scaling), else the ramp's blend in [0, 1] */
    float   yarn_ext_factor;
    float   yarn_attn_factor;    /* multiplies cos/sin (GGML adds YaRN's own 1 + 0.1 ln factor); 0 = 1 */
    float   yarn_beta_fast;      /* the ramp's ends in turns of the original context (32 and 1 in */
    float   yarn_beta_slow;      /* llama.cpp); both > 0, fast > slow, when ext_factor != 0 */
    int32_t n_ctx_orig_yarn;     /* the context YaRN stretches (rope.scaling.original_context_length);
                                    0 = n_ctx_train */
    /* Per-layer shapes (gemma4), n_layer entries each, copied at pp_model_create; NULL: the
     * scalar above for every layer. head_dim then gives the output of rope_freqs (n_rot / 2
     * pairs) and must be the largest layer_head_dim. */
    const int32_t *layer_head_dim;   /* key (and value) head size, even, <= 512 */
    const int32_t *layer_n_head_kv;  /* divides n_head */
    const int32_t *layer_n_rot;      /* even, <= the layer's head size */
    const int32_t *layer_n_ff;       /* the dense FFN's width */
    const int32_t *layer_kv_source;  /* -1: the layer computes its own K/V; else an earlier layer
                                        that does, of the same window and shapes, whose K/V it reads */
    int32_t n_embd_per_layer;        /* gemma4's per-layer embedding width (E2B/E4B); 0 = none */
    /* Gated DeltaNet hybrids (PP_ARCH_QWEN35, PP_ARCH_QWEN35MOE; 0 and NULL for the others).
     * rope_type is then 40 (GGML_ROPE_TYPE_IMROPE). */
    const int32_t *layer_recurrent; /* n_layer entries: 1 = a Gated DeltaNet layer, 0 = full attention;
                                       copied at pp_model_create; at least one of each */
    int32_t ssm_d_conv;          /* the short convolution's kernel, 2..64 (ssm.conv_kernel) */
    int32_t ssm_d_state;         /* each linear head's key and value size S (ssm.state_size) */
    int32_t ssm_n_group;         /* query/key heads H_k of a linear layer (ssm.group_count) */
    int32_t ssm_dt_rank;         /* value heads H_v (ssm.time_step_rank), a multiple of H_k */
    int32_t rope_sections[4];    /* IMRoPE's sections of rotary pairs (rope.dimension_sections) */
    int32_t n_ff_shexp;          /* the shared expert's width (PP_ARCH_QWEN35MOE) */
} pp_model_hparams;

typedef struct pp_model pp_model;

/* Create an empty model for these hyper-parameters; weights are attached
 * with pp_model_set_tensor. PP_ERR_INVALID names the bad field. */
int32_t pp_model_create(const pp_model_hparams *hparams, pp_model **out);

/* Destroy a model. NULL is accepted. Contexts and caches using it must be
 * destroyed first. */
void pp_model_destroy(pp_model *model);

/* Attach one weight tensor by its GGUF name. type is a ggml_type value,
 * ne the GGML shape (ne[0] = row length, 1 <= n_dims <= 4), data the
 * tensor's n_bytes bytes, which must be exactly what GGML's layout of that
 * type and shape takes (so a disagreeing type table in the caller cannot
 * make GGML read past the buffer). data is
 * borrowed for the model's whole life (the caller keeps the file mapped).
 * Unknown names are ignored (*used = 0); a known name with the wrong shape
 * or an unsupported type fails with a message naming the tensor. The
 * optional "rope_freqs.weight" ([n_rot / 2] f32 divisors of each rotary
 * pair's frequency, Llama 3.1's rope scaling) applies to every layer. */
int32_t pp_model_set_tensor(pp_model *model, const char *name, int32_t type,
                            const int64_t *ne, int32_t n_dims, const void *data, int64_t n_bytes,
                            int32_t *used);

/* Check that every tensor the architecture needs is attached; the error
 * names the first missing one. Must succeed before a context is created. */
int32_t pp_model_finalize(pp_model *model);

/* Move the weights that only feed matrix multiplications (attention and
 * FFN projections, an untied output head) into GGML's CPU "extra" buffer
 * types when one supports the tensor (e.g. Q4_0/Q4_K/IQ4_NL repacked into
 * interleaved rows for AVX2 GEMM). Those tensors' bytes are copied into
 * buffers the model owns, so the mapping is no longer read for them; the
 * rest stay borrowed. Call once, after pp_model_finalize and before any
 * context is created. *n_repacked (may be NULL) receives the number of
 * tensors moved; a GGML without extra buffer types moves none and succeeds.
 * Unlike other calls, a failure part way leaves the tensors moved so far
 * moved (the model stays usable) and a second call is refused.
 * The moved tensors' borrowed bytes are advised MADV_PAGEOUT (contents kept),
 * so a file mapping's pages for them leave the resident set.
 * PP_ERR_NO_MEMORY if a buffer cannot be allocated (the model is unchanged
 * for tensors not yet moved and remains usable). */
int32_t pp_model_repack_weights(pp_model *model, int32_t *n_repacked);

/* ---- devices: GGML's backends --------------------------------------------- */

/* What kind of device GGML reports (ggml_backend_dev_type). */
enum pp_device_type {
    PP_DEVICE_CPU   = 0,
    PP_DEVICE_GPU   = 1,  /* dedicated memory */
    PP_DEVICE_IGPU  = 2,  /* integrated, sharing host memory */
    PP_DEVICE_ACCEL = 3   /* an accelerator working beside the CPU backend (BLAS, AMX) */
};

typedef struct pp_device_info {
    char    name[64];          /* GGML's name, e.g. "CPU", "Vulkan0", "CUDA0" (truncated to fit) */
    char    description[128];  /* e.g. the GPU's model */
    int32_t type;              /* enum pp_device_type */
    int64_t memory_free;       /* bytes, as the device reports them now */
    int64_t memory_total;
} pp_device_info;

/* The number of devices in GGML's registry (the CPU is one). Cannot fail. */
int32_t pp_device_count(void);

/* Describe device index (0 <= index < pp_device_count()) into *out.
 * PP_ERR_INVALID for an index GGML does not list. */
int32_t pp_device_get(int32_t index, pp_device_info *out);

/* Copy the weights of the last n_layers decoder layers (all of them when
 * n_layers >= n_layer) into a buffer of GGML device `device`, and with
 * offload_output the output norm and head too (a head tied to the token
 * embedding gets a copy there; the embedding lookup stays on the CPU). The
 * graph then runs those layers' ops on the device (GGML's scheduler, the
 * CPU as fallback) and a KV cache made afterwards keeps their pools there.
 * Call once, after pp_model_finalize and before pp_model_pack_panels,
 * pp_model_repack_weights and any KV cache or context; the weights left on
 * the CPU are packed and repacked as usual. The model owns the device
 * buffer; the moved weights' borrowed bytes are advised MADV_PAGEOUT.
 * A head larger than the device takes in one tensor (ask
 * pp_model_layer_device) stays on the CPU. n_layers = 0 and
 * offload_output = 0 do nothing and succeed.
 * PP_ERR_INVALID: an unknown device, the CPU device, an encoder-only model, a hybrid
 * (Gated DeltaNet layers: their state pool is in host memory),
 * a second call, a call after packing/repacking, or a layer weight the
 * device cannot hold in one tensor. PP_ERR_NO_MEMORY: the
 * device cannot hold the weights (the message gives the size); the model is
 * unchanged and stays usable on the CPU. */
int32_t pp_model_offload(pp_model *model, int32_t device, int32_t n_layers, int32_t offload_output);

/* Where layer il runs: its GGML device index, or -1 for the CPU;
 * il == n_layer asks about the output head. -1 for a NULL model or an il
 * outside [0, n_layer]. */
int32_t pp_model_layer_device(const pp_model *model, int32_t il);

/* Bytes of the model's weights on its device (0: nothing offloaded). */
int64_t pp_model_device_bytes(const pp_model *model);

/* The kernel pp_model_pack_panels packed the weights for. */
enum pp_panel_kernel {
    PP_PANEL_KERNEL_NONE       = 0,  /* nothing packed: GGML's own products are faster here */
    PP_PANEL_KERNEL_SCALAR     = 1,  /* portable C: for tests on any CPU, never chosen for speed */
    PP_PANEL_KERNEL_AVXVNNI    = 2,  /* AVX-VNNI (256-bit, 16 registers) */
    PP_PANEL_KERNEL_AVX512VNNI = 3,  /* AVX-512 VNNI (with VL and BW; float panels: AVX-512F FMAs) */
    PP_PANEL_KERNEL_AVX2       = 4   /* AVX2 byte products (maddubs): K-quant and MXFP4 weights; FMAs for float ones */
};

/* Pack the weights our GEMMs multiply faster than GGML into row panels
 * (q8_panels.h in the sources): Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K and
 * MXFP4 projections for the integer GEMM, F16 and BF16 ones for the float
 * GEMM (f32 FMAs on unrounded activations; on an AVX2 CPU without VNNI: the
 * K-quants, MXFP4 and float weights only) and the
 * output head (output.weight, or token_embd.weight when tied: the input
 * embedding is then read from the panels too) of whole 8-row panels and
 * 32-value blocks; and the routed experts' tensors (ffn_{gate,up,down}_exps)
 * of those types, each expert's matrix in panels of its own, multiplied
 * with a step's tokens grouped by expert. An exact change of layout in the same number of bytes
 * (Q4_K: 2.8% more, Q5_K 2.3%: their 6-bit sub-block scales unpacked to
 * bytes; MXFP4: the same 17 bytes per 32 values).
 * Done only where the CPU has AVX-512 VNNI (with VL and BW), AVX-VNNI or AVX2,
 * unless any_cpu is set (then a portable, slow kernel runs elsewhere: for
 * tests). Call once, after pp_model_finalize, before
 * pp_model_repack_weights and before any context is created. *kernel (may
 * be NULL) receives the kernel (enum pp_panel_kernel; PP_PANEL_KERNEL_NONE
 * when nothing was packed); *n_packed (may be NULL) the number of
 * weights packed (a layer's expert tensor, all its experts, counts as one). The model owns the panels; the packed weights' borrowed
 * bytes are advised MADV_PAGEOUT. The packing runs on one thread per online
 * CPU (at most 16), all joined before it returns. PP_ERR_NO_MEMORY: the
 * panels could not all be allocated; nothing is packed and the model is
 * unchanged and usable; PP_ERR_INVALID: called twice, or after
 * pp_model_repack_weights. */
int32_t pp_model_pack_panels(pp_model *model, int32_t any_cpu, int32_t *kernel, int32_t *n_packed);

/* A LoRA adapter of a model: for each projection it changes (a decoder
 * layer's attn_q/k/v/output or dense ffn_gate/up/down), the pair A [in, rank]
 * and B [rank, out] (GGML order) of a GGUF adapter as llama.cpp's converter
 * writes it ("<base tensor name>.lora_a" / ".lora_b"). A step adds
 * user_scale * alpha / rank * B (A x) to the base product of each token of
 * a sequence running it (alpha 0: user_scale alone, as llama.cpp reads it);
 * the base weights are never changed, so sequences with different adapters,
 * or none, run in one step (pp_batch.loras). */
typedef struct pp_lora pp_lora;

/* The most different adapters one step may run. */
enum { PP_LORA_MAX_PER_STEP = 64 };

/* An empty adapter of model (borrowed: it must outlive the adapter) with
 * the file's adapter.lora.alpha; pairs are attached with pp_lora_set_tensor.
 * PP_ERR_INVALID for a model not finalized, an encoder model or a
 * non-finite alpha. Free with pp_lora_destroy. */
int32_t pp_lora_create(const pp_model *model, float alpha, pp_lora **out);

/* Destroy an adapter. NULL is accepted. No step may be running with it. */
void pp_lora_destroy(pp_lora *lora);

/* Attach one tensor of the adapter file by its GGUF name; data is n_bytes
 * bytes in GGML's layout of type and shape ne (n_dims), borrowed until
 * pp_lora_finalize copies it. A "*_norm.weight" tensor (mergekit writes
 * them) is ignored, as llama.cpp does. PP_ERR_INVALID, naming the tensor,
 * for a name that is neither .lora_a nor .lora_b, a base that is not a
 * projection of the model's layers (or one with routed experts), a shape
 * that does not fit the base's ([in, rank] for A, [rank, out] for B), a
 * type without a CPU product, a wrong byte count or a second copy. */
int32_t pp_lora_set_tensor(pp_lora *lora, const char *name, int32_t type, const int64_t *ne, int32_t n_dims,
                           const void *data, int64_t n_bytes);

/* Check that every pair is complete with one rank and copy the weights
 * into host memory the adapter owns (the data given to pp_lora_set_tensor
 * may be released afterwards). PP_ERR_INVALID names the first incomplete or
 * mismatched pair, or says the adapter holds none; PP_ERR_NO_MEMORY if the
 * copy cannot be allocated. A failed finalize leaves the adapter unusable:
 * destroy it. */
int32_t pp_lora_finalize(pp_lora *lora);

/* The adapter's complete pairs, and the bytes its weights take (0 before
 * pp_lora_finalize). Counts, not statuses: 0 for NULL. */
int32_t pp_lora_n_pairs(const pp_lora *lora);
int64_t pp_lora_bytes(const pp_lora *lora);

/* ---- KV cache ----------------------------------------------------------- */

typedef struct pp_kv_cache pp_kv_cache;

/* K and V pools of num_blocks * block_size token rows, of kv_type (a
 * ggml_type: F16, Q8_0 or Q4_0), for the block pool of the same shape
 * (pp_pool_create_grouped). Layer il belongs to group layer_group[il]
 * (n_layer entries, copied; all 0 for an ungrouped pool, n_groups 1; a hybrid's
 * recurrent layers keep no K/V, and their entries are ignored). Where
 * every group has the same number of layers L and every layer the same row
 * width, the cache holds L K and L V tensors of num_blocks * block_size rows:
 * the i-th layer of every group shares the i-th tensor, each physical block
 * holding the group it was taken for, so one block costs L layers' rows,
 * whatever its group. Otherwise (layers of different head sizes or KV heads,
 * gemma4) one K and one V tensor hold in each slot the rows of the layers of
 * the group that took the block, side by side: a block costs the widest
 * group's rows. A layer that reads an earlier layer's KV (layer_kv_source)
 * has no rows of its own; it must be in its source's group. For paged=0
 * each block is one sequence's contiguous slab (block_size = n_ctx, one
 * group) and attention uses GGML's own flash-attention op instead of the
 * paged kernel. The pools of layers offloaded to a device
 * (pp_model_offload) are allocated there. On success *out owns the cache; free it with
 * pp_kv_cache_destroy, before the model. Fails with PP_ERR_INVALID naming
 * the problem (a head size that is not whole quantization groups, a group
 * with no layer of KV of its own, a shared-KV layer outside its source's
 * group, a group id outside [0, n_groups), a pool larger than the
 * model's device binds in one tensor), PP_ERR_NO_MEMORY if the pools cannot
 * be allocated (on a device: the message names it and the size). */
int32_t pp_kv_cache_create_grouped(const pp_model *model, int32_t kv_type, int32_t num_blocks,
                                   int32_t block_size, int32_t paged, int32_t n_groups,
                                   const int32_t *layer_group, pp_kv_cache **out);

void pp_kv_cache_destroy(pp_kv_cache *cache);

/* Bytes of K plus V one token occupies across all attention layers (without
 * freeing; a layer that reads another's KV adds none). A size, not a status: 0
 * for a NULL cache. */
int64_t pp_kv_cache_bytes_per_token(const pp_kv_cache *cache);

/* Bytes of K plus V one slot of a block holds: one token of one group
 * (all attention layers for an ungrouped cache). A block is block_size slots. A size,
 * not a status: 0 for a NULL cache. */
int64_t pp_kv_cache_bytes_per_slot(const pp_kv_cache *cache);

/* Copy whole blocks (all layers, K and V): the copy-on-write pairs the
 * block pool reported. Pairs are validated before any copy is made:
 * PP_ERR_INVALID (nothing copied) for an id out of range or src == dst. */
int32_t pp_kv_cache_copy_blocks(pp_kv_cache *cache, const pp_block_copy *copies, int32_t n_copies);

/* Copy one block's K and V rows (the layers of the group holding it, from
 * host or device pools) out to host memory `dst` of pp_kv_cache_bytes_per_slot * block_size bytes, or back in
 * from `src` (the caller's, borrowed). PP_ERR_INVALID for a block id out of range. */
int32_t pp_kv_cache_read_block(const pp_kv_cache *cache, int32_t block_id, void *dst);
int32_t pp_kv_cache_write_block(pp_kv_cache *cache, int32_t block_id, const void *src);

/* How many layers' pools live on the model's device (pp_model_offload): a
 * pool is there when every layer sharing it runs there. 0 for NULL. */
int32_t pp_kv_cache_device_layers(const pp_kv_cache *cache);

/* ---- forward step ------------------------------------------------------- */

/* One batched forward step over any mix of sequences. Token i belongs to
 * sequence seq_index[i] (a row of block_tables), sits at position
 * positions[i] and its K/V go to slot_mapping[i]. Tokens of one sequence
 * are contiguous and in position order; every earlier position of each
 * sequence is already in the cache. block_tables is n_seqs rows of
 * max_blocks_per_seq block ids (unused entries -1). Logits are returned
 * for the token indices in logit_rows. With n_groups > 1 (a grouped cache;
 * 0 means 1) slot_mapping holds n_groups runs of n_tokens slots and
 * block_tables n_groups runs of n_seqs rows, group-major: a layer reads and
 * writes its group's. */
typedef struct pp_batch {
    int32_t        n_tokens;
    const int32_t *token_ids;
    const int32_t *positions;
    const int32_t *slot_mapping;
    const int32_t *seq_index;
    int32_t        n_seqs;
    const int32_t *block_tables;
    int32_t        max_blocks_per_seq;
    int32_t        n_logits;
    const int32_t *logit_rows;
    int32_t        n_groups;
    /* Rows whose final hidden state (after the output norm, before the
     * output head) is wanted instead of logits: embeddings. n_hidden 0 and
     * NULLs: none. hidden receives n_hidden * n_embd floats (row-major),
     * owned by the caller. A row may be in both lists. */
    int32_t        n_hidden;
    const int32_t *hidden_rows;
    float         *hidden;
    /* 1: of the logit rows the caller reads only their argmax ids
     * (pp_context_step_argmax), as greedy decoding does: a context that
     * computes them on a device then copies back n_logits ids instead of
     * n_logits x n_vocab floats, and pp_context_step_logits gives NULL.
     * 0 (or where the context computes no ids): the logits as usual. */
    int32_t        argmax_only;
    /* LoRA adapters: sequence s runs loras[seq_lora[s]] with user scale
     * seq_lora_scale[s] (n_seqs entries each), or no adapter where
     * seq_lora[s] is -1. n_loras 0 and NULLs: no adapter in the step. At
     * most the count pp_context_reserve_loras reserved; every adapter made
     * for the context's model and finalized (PP_ERR_INVALID otherwise). */
    int32_t        n_loras;
    pp_lora *const *loras;
    const int32_t *seq_lora;
    const float   *seq_lora_scale;
    /* Rows whose input is a given embedding instead of their token's (an
     * image's rows, from pp_vision_encode): embd_rows strictly increasing
     * in [0, n_tokens), embd n_embd_rows * n_embd floats (row-major,
     * borrowed for the call). Such a row's token id must still be valid (it
     * is looked up and then replaced) and the model's embedding scale is not
     * applied to it. n_embd_rows 0 and NULLs: none. */
    int32_t        n_embd_rows;
    const int32_t *embd_rows;
    const float   *embd;
    /* Hybrid models: state_slots[s] is the slot of sequence row s in the context's state pool
     * (pp_context_set_state_pool), n_seqs distinct slots, each taken. The step reads each
     * sequence's recurrent state there and writes the state after its last token back in
     * the same computation; a sequence whose first token is at position 0 must come with a
     * zeroed slot (pp_state_pool_alloc, pp_state_pool_zero). NULL for other models. */
    const int32_t *state_slots;
} pp_batch;

typedef struct pp_context pp_context;

/* A compute context: a pool of n_threads worker threads (at most 512; idle
 * workers sleep), room for max_batch_tokens tokens per step. model and
 * cache are borrowed and must outlive it. A context is used by one thread
 * at a time. After fork() the child's first call gives the context a new
 * pool (the parent's workers do not exist there). For a model offloaded to
 * a device (pp_model_offload) the context also starts that device's GGML
 * backend and runs each step through GGML's scheduler (the device first,
 * the CPU as fallback); such a context refuses to run in a forked child
 * (PP_ERR_INVALID), and PP_ERR_INVALID if the device's backend cannot start. */
int32_t pp_context_create(pp_model *model, pp_kv_cache *cache, int32_t n_threads,
                          int32_t max_batch_tokens, pp_context **out);

void pp_context_destroy(pp_context *ctx);

/* Change the number of worker threads (starts a new pool and joins the
 * old one; no decode may be running on the context). PP_ERR_INVALID for
 * n_threads outside 1..512, PP_ERR_NO_MEMORY if the new pool cannot be
 * started (the old one is kept). */
int32_t pp_context_set_threads(pp_context *ctx, int32_t n_threads);

/* Run one step; logits receives n_logits * n_vocab floats (row-major),
 * batch->hidden the hidden rows asked for (see pp_batch). logits may be NULL:
 * the rows are then read in place with pp_context_step_logits (no copy).
 * PP_ERR_INVALID (nothing computed, cache untouched) for a malformed batch:
 * out-of-range ids, slots, positions or sequence indices; for a hybrid model
 * also no state pool, or state_slots missing, not taken or repeated; or its
 * runs changing length more than 128 times (order the sequences by length).
 * PP_ERR_NO_MEMORY (nothing computed) if the step's buffers cannot be had.
 * PP_ERR_COMPUTE if the computation started and failed or was aborted
 * (pp_context_abort): logits are undefined, and so are the KV rows of the
 * batch's slots, which the caller must treat as not computed, and a hybrid's
 * state slots of the batch's sequences (recompute them from their first
 * token). Blocks outside the slot mapping (a shared prefix, cached blocks)
 * and state slots of sequences outside the batch are never written.
 * The step allocates no memory of its own beyond what GGML's graph allocator
 * reserved: the attention kernel's tiles are made with the context. */
int32_t pp_context_decode(pp_context *ctx, const pp_batch *batch, float *logits);

/* The last successful step's logits, n_rows x n_vocab floats (row-major), in
 * the context's compute buffer: owned by the context, valid until the next
 * pp_context_decode on it or its destruction. NULL (and *n_rows 0) before
 * the first step, after a failed one, or when the step asked for no logits. */
const float *pp_context_step_logits(const pp_context *ctx, int32_t *n_rows);

/* Where a step computes each logit row's argmax (its greedy token) as part
 * of its graph. */
enum pp_argmax_mode {
    PP_ARGMAX_ON_DEVICE = 0,   /* when the output head runs on a device (the default): its
                                  ids come back instead of its logits (pp_batch.argmax_only) */
    PP_ARGMAX_ALWAYS    = 1,   /* every step with logits, wherever it runs */
    PP_ARGMAX_NEVER     = 2
};

/* Choose where later steps compute argmax ids. PP_ERR_INVALID for an unknown mode. */
int32_t pp_context_set_argmax(pp_context *ctx, int32_t mode);

/* The last successful step's argmax id per logit row (the first of equal
 * maxima), owned by the context, valid until its next step. NULL (and
 * *n_rows 0) when that step computed none (see pp_argmax_mode) or asked for
 * no logits. */
const int32_t *pp_context_step_argmax(const pp_context *ctx, int32_t *n_rows);

/* The columns a step's matrix products compute for n tokens (or logit rows):
 * n, or n rounded up to a multiple of 4 where GGML's CPU GEMMs would take a
 * slow path (see graph.c). The scheduler's step-cost model counts these.
 * A count, not a status: cannot fail. */
int32_t pp_matmul_columns(int32_t n);

/* How paged attention is computed. */
enum pp_attention_path {
    PP_ATTENTION_KERNEL = 0,   /* our paged-attention operator (CPU; the default) */
    PP_ATTENTION_GATHER = 1    /* GGML ops only: each sequence's pages gathered by slot
                                  (ggml_get_rows), then GGML's flash attention: the
                                  portable path, for any backend GGML has */
};

/* Choose the attention path of later steps (paged caches; slabs always use
 * GGML's flash attention). PP_ERR_INVALID for an unknown path. */
int32_t pp_context_set_attention_path(pp_context *ctx, int32_t path);

/* What the context's steps cost on the host, for benchmarks and tests. A
 * step whose shape (tokens, logit rows, thread count, and the attention's
 * grouping and bucketed key counts) equals the previous step's runs that
 * step's graph again: no build, allocation or scheduling. */
typedef struct pp_step_stats {
    int32_t n_nodes;       /* the last graph's nodes */
    int32_t n_inputs;      /* its input tensors, each set every step */
    int64_t input_bytes;   /* their bytes */
    int32_t reused;        /* 1: the last step ran the previous step's graph */
    int64_t n_builds;      /* graphs built since the context was made */
    int64_t n_steps;       /* steps computed since the context was made */
} pp_step_stats;

/* Copy the context's step statistics to *out. PP_ERR_INVALID for NULL. */
int32_t pp_context_step_stats(const pp_context *ctx, pp_step_stats *out);

/* Ask the step running on ctx, or the next one if none runs, to stop; it
 * returns PP_ERR_COMPUTE. Safe to call from any thread (it only sets a
 * flag); PP_ERR_INVALID for NULL. The flag is read between the ops GGML's
 * CPU backend runs: with every layer on a device (whose backends have no
 * abort hook) a step stops at its CPU ops, or the next step does. */
int32_t pp_context_abort(pp_context *ctx);

/* Make room for steps that run up to max_loras different LoRA adapters
 * (1..PP_LORA_MAX_PER_STEP): their graphs' extra nodes and the per-step
 * plan of which tokens run which adapter. Until then a step with adapters
 * fails with PP_ERR_INVALID. Asking for fewer than reserved keeps what is
 * there. No step may be running on the context. PP_ERR_INVALID for a bad
 * count, PP_ERR_NO_MEMORY if the room cannot be had (the context keeps
 * what it had and stays usable). */
int32_t pp_context_reserve_loras(pp_context *ctx, int32_t max_loras);
/* ---- recurrent state pool (hybrid models) -------------------------------- */

/* A Gated DeltaNet layer keeps a fixed-size state per sequence instead of KV rows: the last
 * ssm_d_conv - 1 inputs of its convolution and a delta-rule matrix per value head. A state
 * pool holds num_slots such states, one slot per running sequence, all of the model's linear
 * layers in f32: it lives beside the block pool and is budgeted with it (bytes_per_slot). A
 * slot's bytes, as pp_state_pool_read gives them: for each linear layer in order, its
 * convolution state [(d_conv - 1) x channels] (the inputs oldest first, a row of d_conv - 1
 * per channel; channels are q, k then v, as attn_qkv's rows), then its delta-rule state
 * [S x S x H_v] (per value head, a row of S per value dimension, the key index fastest). */
typedef struct pp_state_pool pp_state_pool;

/* Bytes of one sequence's recurrent state under model (0 for a model without recurrent
 * layers or NULL). A size, not a status. */
int64_t pp_model_state_bytes(const pp_model *model);

/* A pool of num_slots zeroed, free state slots for a hybrid model (borrowed; it must
 * outlive the pool), in host memory. PP_ERR_INVALID for a model without recurrent layers
 * or num_slots outside 1..1048576, PP_ERR_NO_MEMORY if the bytes cannot be had. */
int32_t pp_state_pool_create(const pp_model *model, int32_t num_slots, pp_state_pool **out);

/* Destroy a pool. NULL is accepted. Contexts using it must be destroyed (or given another
 * pool) first. */
void pp_state_pool_destroy(pp_state_pool *pool);

/* Take a free slot (the lowest id), zeroed: the state of a sequence with no token yet, into
 * *slot. PP_ERR_OUT_OF_BLOCKS when every slot is taken (nothing changes): free a slot, or
 * queue the sequence. */
int32_t pp_state_pool_alloc(pp_state_pool *pool, int32_t *slot);

/* Give a taken slot back. PP_ERR_INVALID for a slot out of range or not taken. */
int32_t pp_state_pool_free(pp_state_pool *pool, int32_t slot);

/* Copy taken slot src's state over taken slot dst (a fork: the child continues where the
 * parent is). PP_ERR_INVALID for a slot out of range or not taken, or src == dst. */
int32_t pp_state_pool_copy(pp_state_pool *pool, int32_t src, int32_t dst);

/* Zero a taken slot: its sequence starts again from its first token (recompute after
 * preemption). PP_ERR_INVALID for a slot out of range or not taken. */
int32_t pp_state_pool_zero(pp_state_pool *pool, int32_t slot);

/* Copy a taken slot's state out to host memory dst (pp_state_pool_bytes_per_slot bytes, the
 * layout above; the caller's), or in from src: swap and tests. PP_ERR_INVALID for a slot out
 * of range or not taken, or a NULL buffer. */
int32_t pp_state_pool_read(const pp_state_pool *pool, int32_t slot, void *dst);
int32_t pp_state_pool_write(pp_state_pool *pool, int32_t slot, const void *src);

/* Sizes and counts, not statuses: 0 for a NULL pool. */
int64_t pp_state_pool_bytes_per_slot(const pp_state_pool *pool);
int32_t pp_state_pool_num_slots(const pp_state_pool *pool);
int32_t pp_state_pool_num_free(const pp_state_pool *pool);

/* Give a context the state pool its steps read and write (borrowed: it must outlive the
 * context or be replaced first); a hybrid model's context decodes nothing without one.
 * PP_ERR_INVALID for a pool made for another model, or a pool for a model without
 * recurrent layers. */
int32_t pp_context_set_state_pool(pp_context *ctx, pp_state_pool *pool);

/* ---- encoder (embedding models) ----------------------------------------- */

/* A compute context for an encoder-only model (PP_ARCH_BERT): bidirectional
 * attention over each input, no KV cache, many inputs per graph (padded to
 * the longest, masked). model is borrowed and must outlive it; one thread
 * at a time. n_threads 1..512 (a pool of its own, sleeping when idle);
 * max_batch_tokens bounds n_seqs * longest input per call. PP_ERR_INVALID for
 * a decoder model, an unfinalized one or bad sizes, PP_ERR_NO_MEMORY if the
 * backend or pool cannot be had. */
typedef struct pp_encoder pp_encoder;

int32_t pp_encoder_create(pp_model *model, int32_t n_threads, int32_t max_batch_tokens, pp_encoder **out);

/* Destroy an encoder context. NULL is accepted. */
void pp_encoder_destroy(pp_encoder *enc);

/* Pooling of an input's token states (llama.cpp's pooling_type values). */
enum pp_pooling {
    PP_POOLING_NONE = 0,   /* every token's state */
    PP_POOLING_MEAN = 1,
    PP_POOLING_CLS  = 2,   /* the first token's */
    PP_POOLING_LAST = 3    /* the last token's */
};

/* Encode n_seqs inputs in one graph: input i is seq_lens[i] (>= 1, at most
 * the model's context) tokens, the inputs' ids concatenated in token_ids;
 * token_types the same layout or NULL (all 0). out receives n_seqs * n_embd
 * floats for a pooling, or sum(seq_lens) * n_embd for PP_POOLING_NONE, the
 * last layer's states, not normalized. Everything is checked before anything
 * is computed: PP_ERR_INVALID for bad ids, lengths or pooling, or
 * n_seqs * max(seq_lens) above max_batch_tokens; PP_ERR_NO_MEMORY if the
 * compute buffer cannot be had; PP_ERR_COMPUTE if GGML failed (out is then
 * undefined). */
int32_t pp_encoder_embed(pp_encoder *enc, const int32_t *token_ids, const int32_t *token_types,
                         const int32_t *seq_lens, int32_t n_seqs, int32_t pooling, float *out);

/* ---- vision projectors (mmproj files) --------------------------------------- */

/* Projector types (llama.cpp's clip.projector_type names). */
enum pp_projector {
    PP_PROJECTOR_GEMMA3 = 0   /* SigLIP tower; avg-pool scale_factor^2 patches, RMS norm, projection */
};

/* A vision tower's hyper-parameters, read from the clip.* metadata by the caller. */
typedef struct pp_vision_hparams {
    int32_t projector;        /* enum pp_projector */
    int32_t image_size;       /* the square side images are resized to, in pixels */
    int32_t patch_size;       /* divides image_size */
    int32_t n_embd;           /* the tower's width */
    int32_t n_head;           /* divides n_embd */
    int32_t n_ff;
    int32_t n_layer;
    int32_t scale_factor;     /* gemma3: patches pooled per side into one token; divides the grid side */
    int32_t projection_dim;   /* the text model's width: each embedding row's length */
    float   eps;              /* the layer norms' (and the projector's RMS norm's) epsilon */
} pp_vision_hparams;

typedef struct pp_vision pp_vision;

/* Create a vision encoder for these hyper-parameters with a compute thread
 * pool of n_threads (1..512, sleeping when idle); weights are attached with
 * pp_vision_set_tensor. *out owns it; free with pp_vision_destroy.
 * PP_ERR_INVALID names a bad field; PP_ERR_NO_MEMORY if the backend, pool or
 * metadata cannot be had (nothing is left allocated). */
int32_t pp_vision_create(const pp_vision_hparams *hparams, int32_t n_threads, pp_vision **out);

/* Destroy a vision encoder. NULL is accepted. */
void pp_vision_destroy(pp_vision *vision);

/* Attach one tensor by its GGUF name ("v.patch_embd.weight",
 * "v.blk.<il>.attn_q.weight", "mm.input_projection.weight", ...), as
 * pp_model_set_tensor does: data borrowed for the encoder's life, n_bytes
 * exactly GGML's size of that type and shape, unknown names ignored
 * (*used = 0), a known name with the wrong shape or type (norms, biases and
 * the position embedding must be f32; matrices need a CPU product) refused
 * with a message naming it. Refused after pp_vision_finalize. */
int32_t pp_vision_set_tensor(pp_vision *vision, const char *name, int32_t type, const int64_t *ne,
                             int32_t n_dims, const void *data, int64_t n_bytes, int32_t *used);

/* Check every tensor is attached (the error names the first missing one).
 * Must succeed before pp_vision_encode. */
int32_t pp_vision_finalize(pp_vision *vision);

/* Embedding rows one image becomes (0 for NULL). A count: cannot fail. */
int32_t pp_vision_n_tokens(const pp_vision *vision);

/* Encode one image: pixels are 3 planes of image_size x image_size floats
 * (channel, row, column), already normalised; out receives
 * pp_vision_n_tokens() * projection_dim floats (row-major), owned by the
 * caller. One thread at a time. PP_ERR_INVALID for NULLs or an unfinalized
 * encoder; PP_ERR_NO_MEMORY if the compute buffer cannot be had;
 * PP_ERR_COMPUTE if GGML failed (out is then undefined). */
int32_t pp_vision_encode(pp_vision *vision, const float *pixels, float *out);

/* ---- sampling ------------------------------------------------------------ */

/* A sampler: reusable buffers for one vocabulary size, so a step allocates
 * nothing, one set per thread. Called by one thread at a time (the engine's
 * step); it spreads the rows over up to n_threads threads of its own. */
typedef struct pp_sampler pp_sampler;

/* Most top log-probabilities a row may ask for; it sizes pp_sample_result's
 * arrays, and Python reads it to bound both logprobs and beam search (which
 * asks for 2 x beam_width). */
enum { PP_SAMPLE_MAX_TOP = 32 };

/* How one row is sampled. temperature 0 is greedy (the argmax after
 * penalties and mask). top_k 0, top_p 1 and min_p 0 each turn a filter off. */
typedef struct pp_sampling_params {
    float   temperature;
    int32_t top_k;
    float   top_p;
    float   min_p;
    float   repeat_penalty;      /* 1: none; llama.cpp's rule (positive / p, negative * p) */
    float   presence_penalty;
    float   frequency_penalty;
    int32_t n_logprobs;          /* -1: none; else the chosen token's and this many top log-probs */
} pp_sampling_params;

/* One sequence to sample from row logit_row of the logits. history holds the
 * tokens the penalties count (borrowed); rng_state is the sequence's
 * generator, advanced in place (seed it with pp_sampler_seed); allowed is
 * NULL or n_vocab bytes where 0 masks a token out. */
typedef struct pp_sample_row {
    int32_t            logit_row;
    pp_sampling_params params;
    const int32_t     *history;
    int32_t            n_history;
    uint64_t          *rng_state;
    const uint8_t     *allowed;
} pp_sample_row;

/* What was sampled. logprob and top_* are filled when n_logprobs >= 0:
 * log-probabilities under the model's own distribution (the raw row, before
 * penalties and temperature), top_* highest first. */
typedef struct pp_sample_result {
    int32_t token;
    float   logprob;
    int32_t n_top;
    int32_t top_ids[PP_SAMPLE_MAX_TOP];
    float   top_logprobs[PP_SAMPLE_MAX_TOP];
} pp_sample_result;

/* Most threads one sampler spreads its rows over; Python reads it to clamp. */
enum { PP_SAMPLER_MAX_THREADS = 64 };

/* Create a sampler for n_vocab tokens using up to n_threads threads
 * (1..PP_SAMPLER_MAX_THREADS);
 * free it with pp_sampler_destroy. PP_ERR_INVALID for a bad size or thread
 * count, PP_ERR_NO_MEMORY if its buffers cannot be had. */
int32_t pp_sampler_create(int32_t n_vocab, int32_t n_threads, pp_sampler **out);
void pp_sampler_destroy(pp_sampler *sampler);

/* The generator state for a seed: the same seed gives the same draws,
 * whatever else runs in the batch. Cannot fail. */
uint64_t pp_sampler_seed(uint64_t seed);

/* Sample n_rows rows of logits [n_logit_rows][n_vocab] into out[0..n_rows).
 * Every row is checked before any is sampled: PP_ERR_INVALID (nothing
 * sampled, no generator advanced) for a bad row index, parameter or history
 * token. PP_ERR_INVALID also if a row allows no finite logit: the other rows
 * are sampled, and each such row's result has token -1, so the caller can fail
 * only the sequences whose rows failed. The vocabulary is never sorted (see sampler.c). */
int32_t pp_sample(pp_sampler *sampler, const float *logits, int32_t n_logit_rows, const pp_sample_row *rows,
                  int32_t n_rows, pp_sample_result *out);

/* ---- GGML: logging and build ------------------------------------------- */

/* Route GGML's log messages through a filter that prints to stderr only
 * those at or above level (a ggml_log_level: 1 debug, 2 info, 3 warn,
 * 4 error; continuation lines take their first line's level; 5 or more
 * prints nothing, 0 everything). Until this is first called GGML's own
 * logger prints everything; the Python package calls it at import with 3.
 * The level may be changed from any thread; installing the filter (the
 * first call) should happen before other threads use GGML. */
void pp_set_ggml_log_level(int32_t level);

/* Description of the GGML build this library runs on (its version, CPU
 * features, the attention math variant chosen). Cannot fail; the string is
 * owned by the library (a static buffer rewritten by each call) and never
 * NULL. */
const char *pp_ggml_build_info(void);

#ifdef __cplusplus
}
#endif

#endif /* PYLLAMA_PAGED_H */
