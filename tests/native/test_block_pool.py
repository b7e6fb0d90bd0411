"""Unit tests of the native block pool, one operation at a time."""

import pytest

from pyllama_paged import NativeError, OutOfBlocksError
from pyllama_paged.engine.kv.block_pool import BlockPool, BlockState
from pyllama_paged.errors import PagedError


def test_create_rejects_bad_sizes():
    with pytest.raises(NativeError, match="num_blocks must be >= 1"):
        BlockPool(0, 16)
    with pytest.raises(NativeError, match="block_size must be >= 1"):
        BlockPool(4, 0)


def test_create_allocates_whole_blocks_and_slot_mapping():
    with BlockPool(8, 4) as pool:
        seq, cached = pool.create_sequence([1, 2, 3, 4, 5, 6])
        assert cached == 0
        assert pool.length(seq) == 6
        table = pool.block_table(seq)
        assert len(table) == 2
        assert list(pool.tokens(seq)) == [1, 2, 3, 4, 5, 6]
        slots = pool.slot_mapping(seq, 0, 6)
        assert list(slots) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
        s = pool.stats()
        assert (s.num_used, s.num_free, s.tokens_stored, s.slots_held) == (2, 6, 6, 8)


def test_append_allocates_only_when_last_block_full():
    with BlockPool(8, 4) as pool:
        seq, _ = pool.create_sequence([1, 2, 3])
        assert pool.blocks_needed(seq, 1) == 0
        pool.append(seq, [4])
        assert len(pool.block_table(seq)) == 1
        assert pool.blocks_needed(seq, 1) == 1
        pool.append(seq, [5])
        assert len(pool.block_table(seq)) == 2


def test_fork_shares_blocks_and_cow_copies_last_block():
    with BlockPool(8, 4) as pool:
        parent, _ = pool.create_sequence([1, 2, 3, 4, 5, 6])
        child = pool.fork(parent)
        assert list(pool.block_table(child)) == list(pool.block_table(parent))
        assert all(pool.block_info(b).ref_count == 2 for b in pool.block_table(parent))
        assert pool.stats().num_shared == 2
        shared_last = pool.block_table(parent)[1]
        assert pool.blocks_needed(child, 1) == 1
        copies = pool.append(child, [7])
        new_last = pool.block_table(child)[1]
        assert copies == [(shared_last, new_last)]
        assert new_last != shared_last
        assert pool.block_info(shared_last).ref_count == 1
        assert pool.block_table(child)[0] == pool.block_table(parent)[0]
        # The parent's own append into its now-private last block copies nothing.
        assert pool.append(parent, [8]) == []
        assert list(pool.tokens(child)) == [1, 2, 3, 4, 5, 6, 7]
        assert list(pool.tokens(parent)) == [1, 2, 3, 4, 5, 6, 8]
        assert pool.stats().num_cow_copies == 1


def test_fork_of_full_last_block_needs_no_copy():
    with BlockPool(8, 4) as pool:
        parent, _ = pool.create_sequence([1, 2, 3, 4])
        child = pool.fork(parent)
        assert pool.append(child, [5]) == []
        assert pool.block_info(pool.block_table(parent)[0]).ref_count == 2


def test_a_decode_steps_tokens_are_placed_in_one_call_all_or_none():
    import numpy as np

    ids = lambda *xs: np.array(xs, dtype=np.int32)   # noqa: E731
    with BlockPool(6, 4) as pool:
        a, _ = pool.create_sequence([1, 2, 3, 4, 5, 6])   # 2 blocks, the last half full
        b = pool.fork(a)                                  # shares both
        c, _ = pool.create_sequence([9, 9, 9, 9])         # 1 block, full
        copies = pool.append_each(ids(b, a, c), ids(70, 80, 90))
        # b copies the shared last block; a then writes its own; c takes a new block
        assert len(copies) == 1 and copies[0][0] == pool.block_table(a)[1]
        assert copies[0][1] == pool.block_table(b)[1]
        assert [list(pool.tokens(s))[-1] for s in (a, b, c)] == [80, 70, 90]
        assert [pool.length(s) for s in (a, b, c)] == [7, 7, 5]
        before = [list(pool.tokens(s)) for s in (a, b, c)], pool.stats()
        # 1 free block left: c (new block) fits, a + b + c (one new block each at 8 -> 9) may not
        for s in (a, b):
            pool.append(s, [1])
        before = [list(pool.tokens(s)) for s in (a, b, c)], pool.stats()
        assert pool.append_each(ids(a, b, c), ids(5, 6, 7)) is None   # nothing placed
        assert ([list(pool.tokens(s)) for s in (a, b, c)], pool.stats()) == before
        with pytest.raises(NativeError, match="listed twice"):
            pool.append_each(ids(a, a), ids(1, 2))
        with pytest.raises(NativeError, match="unknown sequence id 99"):
            pool.append_each(ids(a, 99), ids(1, 2))
        assert ([list(pool.tokens(s)) for s in (a, b, c)], pool.stats()) == before


def test_out_of_blocks_is_recoverable_and_changes_nothing():
    with BlockPool(2, 4) as pool:
        seq, _ = pool.create_sequence([1, 2, 3, 4, 5])
        pool.mark_computed(seq, 5)
        before = pool.stats()
        with pytest.raises(OutOfBlocksError, match="out of KV blocks"):
            pool.append(seq, list(range(10)))
        with pytest.raises(OutOfBlocksError):
            pool.create_sequence(list(range(9)))
        assert pool.stats() == before
        assert pool.length(seq) == 5
        pool.append(seq, [6, 7, 8])  # still usable afterwards
        pool.mark_computed(seq, 8)
        pool.free(seq)
        assert pool.num_allocatable == 2


def test_unknown_sequence_names_the_id():
    with BlockPool(2, 4) as pool:
        with pytest.raises(NativeError, match="unknown sequence id 7"):
            pool.append(7, [1])
        seq, _ = pool.create_sequence([1])
        pool.free(seq)
        with pytest.raises(NativeError, match=f"unknown sequence id {seq}"):
            pool.free(seq)


def test_prefix_cache_reuses_full_blocks_after_free():
    with BlockPool(8, 4) as pool:
        prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18]
        a, cached = pool.create_sequence(prompt)
        assert cached == 0
        pool.mark_computed(a, len(prompt))
        table_a = list(pool.block_table(a))
        pool.free(a)
        s = pool.stats()
        assert s.num_cached == 2 and s.num_used == 0
        assert pool.block_info(table_a[0]).state == BlockState.CACHED
        b, cached = pool.create_sequence(prompt)
        assert cached == 8
        assert list(pool.block_table(b))[:2] == table_a[:2]
        s = pool.stats()
        assert s.num_hits == 2 and s.num_misses == 2 and s.num_cached == 0


def test_prefix_cache_shares_blocks_between_live_sequences():
    with BlockPool(8, 4) as pool:
        system = [1, 2, 3, 4, 5, 6, 7, 8]
        a, _ = pool.create_sequence(system + [9])
        pool.mark_computed(a, 9)
        b, cached = pool.create_sequence(system + [20, 21])
        assert cached == 8
        assert list(pool.block_table(a))[:2] == list(pool.block_table(b))[:2]
        assert pool.stats().num_shared == 2
        assert pool.stats().tokens_logical == 9 + 10
        assert pool.stats().tokens_stored == 8 + 1 + 2


def test_prefix_cache_misses_on_a_different_earlier_block():
    with BlockPool(8, 4) as pool:
        a, _ = pool.create_sequence([1, 2, 3, 4, 5, 6, 7, 8])
        b, cached = pool.create_sequence([9, 2, 3, 4, 5, 6, 7, 8])
        assert cached == 0  # the second block's hash chains through the first
        assert not set(pool.block_table(a)) & set(pool.block_table(b))


def test_cached_blocks_are_evicted_lru_when_memory_is_needed():
    with BlockPool(4, 2) as pool:
        a, _ = pool.create_sequence([1, 2])
        b, _ = pool.create_sequence([3, 4])
        pool.mark_computed(a, 2)
        pool.mark_computed(b, 2)
        block_a, block_b = pool.block_table(a)[0], pool.block_table(b)[0]
        pool.free(a)
        pool.free(b)
        assert pool.num_allocatable == 4
        c, _ = pool.create_sequence([5, 6, 7, 8, 9, 10])  # 3 blocks: 2 free + evict oldest
        assert pool.stats().num_evictions == 1
        assert pool.block_info(block_a).state == BlockState.USED  # a was older: evicted, reused
        assert pool.block_info(block_b).state == BlockState.CACHED
        pool.free(c)
        _, cached = pool.create_sequence([3, 4, 11])   # the last token's block is never a hit
        assert cached == 2


def test_explicit_evict_and_reset():
    with BlockPool(4, 2) as pool:
        a, _ = pool.create_sequence([1, 2, 3, 4])
        pool.mark_computed(a, 4)
        pool.free(a)
        assert pool.evict(1) == 1
        assert pool.stats().num_cached == 1
        pool.reset_prefix_cache()
        s = pool.stats()
        assert s.num_cached == 0 and s.num_free == 4
        _, cached = pool.create_sequence([1, 2, 3, 4])
        assert cached == 0


def test_hash_chain_is_deterministic_and_parent_sensitive():
    with BlockPool(4, 3) as pool:
        h1 = pool.hash_block(0, [1, 2, 3])
        assert h1 == pool.hash_block(0, [1, 2, 3])
        assert h1 != pool.hash_block(0, [1, 2, 4])
        assert pool.hash_block(h1, [5]) != pool.hash_block(0, [5])
        seq, _ = pool.create_sequence([1, 2, 3, 5, 6, 7])
        t = pool.block_table(seq)
        assert pool.block_info(t[0]).hash == h1
        assert pool.block_info(t[1]).hash == pool.hash_block(h1, [5, 6, 7])


def test_block_hash_is_keyed_per_pool():
    """A secret key per pool: nobody outside can aim a chain collision at a shared
    prefix (an unkeyed invertible chain let a crafted prompt poison others' KV)."""
    with BlockPool(4, 3) as a, BlockPool(4, 3) as b:
        tokens = [11, 12, 13]
        assert a.hash_block(0, tokens) != b.hash_block(0, tokens)
        a.set_hash_key(1, 2)
        b.set_hash_key(1, 2)
        assert a.hash_block(0, tokens) == b.hash_block(0, tokens)
        b.set_hash_key(1, 3)
        assert a.hash_block(0, tokens) != b.hash_block(0, tokens)
        seq, _ = a.create_sequence(tokens + [1])
        with pytest.raises(PagedError, match="empty"):
            a.set_hash_key(5, 6)
        a.free(seq)


def test_empty_sequence_and_many_sequences():
    with BlockPool(64, 1) as pool:
        ids = [pool.create_sequence([])[0] for _ in range(100)]
        assert len(set(ids)) == 100
        for i in ids:
            pool.free(i)
        assert pool.stats().num_seqs == 0


def test_closed_pool_raises():
    pool = BlockPool(2, 2)
    pool.close()
    with pytest.raises(Exception, match="closed"):
        pool.stats()


def test_blocks_not_yet_computed_are_never_reused_or_cached():
    with BlockPool(8, 4) as pool:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
        a, _ = pool.create_sequence(prompt)
        b, cached = pool.create_sequence(prompt)   # a's KV is still being prefilled
        assert cached == 0
        assert not set(pool.block_table(a)) & set(pool.block_table(b))
        pool.mark_computed(a, 4)                   # only the first block is written
        c, cached = pool.create_sequence(prompt)
        assert cached == 4
        assert pool.block_info(pool.block_table(a)[0]).is_computed
        for seq in (a, b, c):
            pool.free(seq)
        s = pool.stats()
        assert s.num_cached == 1 and s.num_free == 7   # only the computed block stays cached


def test_a_fully_cached_block_aligned_prompt_never_writes_a_cached_block():
    # The last token is always computed again; writing its KV into the cached
    # block would change a block other sequences may share. The pool stops the
    # hits before the block holding the last token, so it gets a fresh block.
    with BlockPool(8, 4) as pool:
        prompt = list(range(10, 18))                       # two full blocks
        a, cached = pool.create_sequence(prompt)
        assert cached == 0
        pool.mark_computed(a, 8)
        first = list(pool.block_table(a))
        b, cached = pool.create_sequence(prompt)
        assert cached == 4                                 # not 8: the second block is recomputed
        table = list(pool.block_table(b))
        assert table[0] == first[0] and table[1] != first[1]
        assert pool.block_info(first[1]).ref_count == 1    # the cached block is not shared with b
        _, cached = pool.create_sequence(prompt + [99])    # one more token: both blocks are hits
        assert cached == 8


def test_a_hash_collision_never_attaches_a_block_to_another_prefix():
    # With 10-bit hashes, find a block t and a first block x2 such that t
    # hashes after x2 exactly as after x1 although x1 and x2 hash apart.
    # Without comparing the stored parent hash, a prompt x2 + t would reuse
    # the KV computed after x1. (The hash is deterministic: so is the search.)
    bits = 10
    mask = (1 << bits) - 1

    keyed = BlockPool(16, 4)   # the pool whose key the search below aims at

    def h(parent, tokens):
        return keyed.hash_block(parent, tokens) & mask or 1

    x1 = [1, 2, 3, 4]
    h1 = h(0, x1)
    for k in range(1000):
        tail = [7, 7, 7, k]
        target = h(h1, tail)
        parents = [p for p in range(1, mask + 1) if p != h1 and h(p, tail) == target]
        if parents:
            break
    x2 = next([5, 6, 8, i] for i in range(1 << 20) if h(0, [5, 6, 8, i]) == parents[0])
    with keyed as pool:
        pool.weaken_hash(bits)
        a, _ = pool.create_sequence(x1 + tail + [0])
        b, _ = pool.create_sequence(x2 + [0])
        pool.mark_computed(a, 8)
        pool.mark_computed(b, 4)
        pool.free(a)
        pool.free(b)
        _, cached = pool.create_sequence(x2 + tail + [0])
        assert cached == 4                                 # x2's own block only


def test_weaken_hash_is_refused_once_the_pool_holds_data():
    with BlockPool(4, 2) as pool:
        pool.create_sequence([1, 2])
        with pytest.raises(NativeError, match="empty"):
            pool.weaken_hash(8)


def test_a_step_batch_is_built_from_the_pool_in_one_call():
    import numpy as np
    from pyllama_paged.engine.kv.manager import PagedKV
    from pyllama_paged.engine.kv.step_batch import StepBuffers

    kv = PagedKV(16, 4, max_seq_len=16)
    a, _ = kv.create([5, 6, 7, 8, 9, 10])      # prefill 6 tokens in a chunk of 4, then 2
    b, _ = kv.create([20, 21, 22])
    c = kv.fork(b)
    kv.append(c, [23])                        # copy-on-write: c's last block is its own
    buffers = StepBuffers()
    work = [(a, 0, 4), (b, 0, 3), (c, 3, 1)]
    buffers.reserve(8, 3, kv.max_blocks_per_seq)
    items = buffers.items(work)
    n_tokens, n_logits = kv.build_batch(items, buffers)
    tok, pos, slots, seqs, tables, rows = buffers.arrays(n_tokens, 3, n_logits)
    assert (n_tokens, n_logits) == (8, 2)
    assert list(tok) == [5, 6, 7, 8, 20, 21, 22, 23]
    assert list(pos) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert list(seqs) == [0, 0, 0, 0, 1, 1, 1, 2]
    want_slots = np.concatenate([kv.slot_mapping(a, 0, 4), kv.slot_mapping(b, 0, 3), kv.slot_mapping(c, 3, 1)])
    assert list(slots) == list(want_slots)
    assert tables.shape[0] == 1               # one layer group
    for row, handle in zip(tables[0], (a, b, c)):
        table = kv.block_table(handle)
        assert list(row[:len(table)]) == list(table) and set(row[len(table):]) <= {-1}
    assert list(rows) == [6, 7]               # a's chunk ends before its last token: no logits row
    kv.commit_batch(items)
    assert kv.pool.block_info(kv.block_table(a)[0]).is_computed   # a's full first block is cacheable
    kv.close()


def test_a_malformed_step_batch_is_refused_before_anything_is_written():
    import numpy as np
    from pyllama_paged.engine.kv.manager import PagedKV
    from pyllama_paged.engine.kv.step_batch import StepBuffers

    kv = PagedKV(8, 4, max_seq_len=16)
    a, _ = kv.create([1, 2, 3])
    buffers = StepBuffers()
    buffers.reserve(4, 2, kv.max_blocks_per_seq)
    tok = buffers.arrays(4, 2, 2)[0]
    tok[:] = -7
    for work, message in [([(a, 0, 3), (99, 0, 1)], "unknown sequence"),
                          ([(a, 2, 2)], "outside sequence"),
                          ([(a, 0, 0)], "outside sequence")]:
        with pytest.raises(NativeError, match=message):
            kv.build_batch(buffers.items(work), buffers)
        assert list(tok) == [-7] * 4
    big, _ = kv.create(list(range(9)))
    with pytest.raises(NativeError, match="exceeds the buffers"):
        kv.build_batch(buffers.items([(big, 0, 9)]), buffers)
    with pytest.raises(NativeError, match="not a range"):
        kv.commit_batch(np.array([[a, 0, 4]], dtype=np.int32))
    kv.close()
