"""Property tests: random create/append/fork/free/evict programs keep the
pool's invariants after every step."""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pyllama_paged import OutOfBlocksError
from pyllama_paged.engine.kv.block_pool import BlockPool, BlockState

# A tiny alphabet makes shared prefixes, and so cache hits, common.
tokens = st.lists(st.integers(0, 3), min_size=0, max_size=12)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.block_size = 3
        self.pool = BlockPool(12, self.block_size)
        self.model: dict[int, list[int]] = {}  # seq id -> expected token ids
        self.hash_of_prefix: dict[tuple, int] = {}

    def teardown(self):
        for seq in list(self.model):
            self.pool.free(seq)
        s = self.pool.stats()
        assert s.num_used == 0 and s.num_free + s.num_cached == s.num_blocks
        assert s.tokens_stored == 0 and s.tokens_logical == 0
        self.pool.close()

    @rule(token_ids=tokens)
    def create(self, token_ids):
        before = self.pool.stats()
        try:
            seq, cached = self.pool.create_sequence(token_ids)
        except OutOfBlocksError:
            assert self.pool.stats() == before
            return
        assert seq not in self.model
        assert cached % self.block_size == 0 and cached <= len(token_ids)
        self.model[seq] = list(token_ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), token_ids=tokens)
    def append(self, data, token_ids):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        before = self.pool.stats()
        old_table = list(self.pool.block_table(seq))
        needed = self.pool.blocks_needed(seq, len(token_ids))
        try:
            copies = self.pool.append(seq, token_ids)
        except OutOfBlocksError:
            assert needed > before.num_free + before.num_cached
            assert self.pool.stats() == before
            return
        new_table = list(self.pool.block_table(seq))
        assert len(new_table) - len(old_table) + len(copies) == needed
        for src, dst in copies:
            # Only the last (partially filled, shared) block is ever copied.
            assert src == old_table[-1] and dst == new_table[len(old_table) - 1]
        self.model[seq].extend(token_ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def mark_computed(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        n = data.draw(st.integers(0, len(self.model[seq])))
        self.pool.mark_computed(seq, n)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child = self.pool.fork(parent)
        assert list(self.pool.block_table(child)) == list(self.pool.block_table(parent))
        self.model[child] = list(self.model[parent])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.pool.free(seq)
        del self.model[seq]

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        cached = self.pool.stats().num_cached
        assert self.pool.evict(n) == min(n, cached)

    @invariant()
    def sequences_hold_their_tokens(self):
        for seq, expected in self.model.items():
            assert list(self.pool.tokens(seq)) == expected
            assert self.pool.length(seq) == len(expected)
            table = self.pool.block_table(seq)
            assert len(table) == -(-len(expected) // self.block_size)

    @invariant()
    def every_block_in_exactly_one_state_with_exact_ref_counts(self):
        refs = Counter()
        for seq in self.model:
            refs.update(int(b) for b in self.pool.block_table(seq))
        counts = Counter()
        for b in range(self.pool.num_blocks):
            info = self.pool.block_info(b)
            counts[info.state] += 1
            assert info.ref_count == refs[b]
            if info.state == BlockState.USED:
                assert info.ref_count > 0
            elif info.state == BlockState.CACHED:
                assert info.ref_count == 0 and info.hash is not None and info.is_computed
                assert info.num_tokens == self.block_size
            else:
                assert info.ref_count == 0 and info.hash is None and not info.is_computed
        s = self.pool.stats()
        assert (counts[BlockState.FREE], counts[BlockState.USED], counts[BlockState.CACHED]) == (
            s.num_free, s.num_used, s.num_cached)
        assert s.num_shared == sum(1 for r in refs.values() if r > 1)
        assert s.num_seqs == len(self.model)
        assert s.tokens_logical == sum(len(t) for t in self.model.values())

    @invariant()
    def same_prefix_same_hash(self):
        for seq, expected in self.model.items():
            table = self.pool.block_table(seq)
            parent = 0
            for i in range(len(expected) // self.block_size):
                block_tokens = tuple(expected[: (i + 1) * self.block_size])
                h = self.pool.block_info(int(table[i])).hash
                assert h == self.pool.hash_block(parent, block_tokens[-self.block_size:])
                assert self.hash_of_prefix.setdefault(block_tokens, h) == h
                parent = h


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
