"""The prefix cache's events (engine/kv/events.py) on a tiny model: what a KV-aware router
is told matches what the pool holds, step after step, through hits, evictions, swaps,
resets and the engine's close."""

import numpy as np
import pytest

from pyllama_paged._native import lib
from pyllama_paged.engine import (AllBlocksCleared, BlockRemoved, BlockStored, LLMEngine, SamplingParams, 
                                  SchedulerConfig)
from pyllama_paged.engine.kv.events import reference_group
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.engine import EngineConfig

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


# `model`: tests/engine/conftest.py's tiny Gemma 3


class Recorder:
    """A KVEventListener that keeps every batch, and the cache a router would rebuild from them."""

    def __init__(self):
        self.batches = []
        self.cached: set[int] = set()

    def kv_events(self, events):
        self.batches.append(events)
        for e in events:
            if isinstance(e, BlockStored):
                assert not self.cached & set(e.block_hashes), "a hash stored twice without a removal"
                self.cached |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.cached, "a hash removed that was never stored"
                self.cached -= set(e.block_hashes)
            else:
                self.cached.clear()

    def events(self, kind):
        return [e for batch in self.batches for e in batch if isinstance(e, kind)]


def engine(model, num_blocks, mode="recompute", windows=False):
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=256, n_threads=1, n_batch=64, block_size=BS,
                                             num_blocks=num_blocks, free_window_blocks=windows))
    llm = LLMEngine(runner, {1}, SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode))
    recorder = Recorder()
    llm.set_kv_event_listener(recorder)
    return llm, recorder


def pool_cache(llm) -> set[int]:
    """The hashes the pool's reference group holds as computed cache entries now."""
    kv = llm.runner.kv
    group = reference_group(kv.groups.group_window)
    held = set()
    for b in range(kv.num_blocks):
        info = kv.pool.block_info(b)
        if info.hash is not None and info.is_computed and info.group == group and info.state != lib.PP_BLOCK_FREE:
            held.add(info.hash)
    return held


def run(llm, recorder, prompts, params=GREEDY):
    """Run prompts together to the end, checking after every step that the events tell the cache."""
    for p in prompts:
        llm.add_request(list(p), params)
    while llm.has_work():
        llm.step()
        assert recorder.cached == pool_cache(llm)


def prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 300, size=length).tolist() for _ in range(n)]


def test_stored_blocks_chain_and_carry_their_tokens(model):
    llm, rec = engine(model, 400)
    assert rec.batches == [[AllBlocksCleared()]]   # a consumer forgets an earlier pool first
    prompt = prompts(1, 70)[0]
    run(llm, rec, [prompt])
    stored = rec.events(BlockStored)
    hashes = [h for e in stored for h in e.block_hashes]
    tokens = [t for e in stored for t in e.token_ids]
    # 70 prompt tokens and 5 of the 6 sampled ones are computed: 4 full blocks
    assert len(hashes) == 75 // BS and all(e.block_size == BS for e in stored)
    assert tokens == prompt[:len(hashes) * BS]
    parent = None
    for e in stored:
        assert e.parent_block_hash == parent
        parent = e.block_hashes[-1]
    pool = llm.runner.kv.pool
    chain = 0
    for i, h in enumerate(hashes):   # each hash is the pool's own chained hash of its tokens
        chain = pool.hash_block(chain, tokens[i * BS:(i + 1) * BS])
        assert h == chain
    llm.close()
    assert rec.batches[-1] == [AllBlocksCleared()]


def test_a_repeated_prompt_stores_nothing_new_and_counts_hits(model):
    llm, rec = engine(model, 400)
    prompt = prompts(1, 64, seed=1)[0]
    run(llm, rec, [prompt])
    before = len(rec.events(BlockStored))
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 64 and stats["prefix_cache_hits"] == 0
    run(llm, rec, [prompt])
    stats = llm.stats()
    # the cached prefix stops before the last prompt token's block: 3 blocks of 16 hit
    assert stats["prefix_cache_queries"] == 128 and stats["prefix_cache_hits"] == 48
    stored = rec.events(BlockStored)[before:]
    # only the blocks past the first answer's computed tokens are new: those it had are not stored again
    assert all(e.parent_block_hash is not None for e in stored)
    llm.close()


@pytest.mark.parametrize("windows", [False, True])
def test_evictions_are_reported_as_removed(model, windows):
    # a pool of few blocks: every new prompt evicts earlier ones' cached blocks
    llm, rec = engine(model, 40 if windows else 12, windows=windows)
    run(llm, rec, prompts(6, 50, seed=2)[:1])
    first = set(rec.cached)
    for p in prompts(6, 50, seed=2)[1:]:
        run(llm, rec, [p])
    removed = {h for e in rec.events(BlockRemoved) for h in e.block_hashes}
    assert first and first <= removed
    assert llm.runner.kv.pool.stats().num_evictions > 0
    llm.close()


def test_concurrent_twins_and_preemption_keep_the_books(model):
    # identical prompts in one batch (a block of the same tokens twice) in a pool too small
    # for all of them at once: preemptions, recomputes and evictions, checked every step
    llm, rec = engine(model, 14)
    batch = prompts(3, 40, seed=3)
    run(llm, rec, batch + batch, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    llm.close()


def test_swapped_sequences_are_stored_again_when_they_return(model):
    llm, rec = engine(model, 12, mode="swap")
    run(llm, rec, prompts(4, 40, seed=4), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert llm.scheduler.num_swaps > 0
    llm.close()


def test_reset_clears_and_later_blocks_are_stored_again(model):
    llm, rec = engine(model, 400)
    prompt = prompts(1, 40, seed=5)[0]
    run(llm, rec, [prompt])
    stored = rec.events(BlockStored)[0].block_hashes
    llm.reset_prefix_cache()
    assert rec.batches[-1] == [AllBlocksCleared()] and pool_cache(llm) == set()
    run(llm, rec, [prompt])
    assert rec.events(BlockStored)[-1].block_hashes[:len(stored)] == stored
    llm.close()


def test_no_listener_no_events_and_slabs_have_none(model):
    runner = ModelRunner(model, EngineConfig(paged=False, n_ctx=256, n_threads=1, n_batch=64, n_seq_max=2))
    llm = LLMEngine(runner, {1}, SchedulerConfig(max_num_batched_tokens=64))
    rec = Recorder()
    llm.set_kv_event_listener(rec)   # no prefix cache: nothing to tell
    llm.add_request(prompts(1, 20)[0], GREEDY)
    while llm.has_work():
        llm.step()
    assert rec.batches == [] and "prefix_cache_queries" not in llm.stats()
    llm.close()
