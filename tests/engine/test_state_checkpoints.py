"""Prefix caching for hybrid models (Qwen3.5/3.6): a cached prefix is reused only up to a
block boundary where a checkpoint of the recurrent state was saved (engine/kv/state_pool.py's
HybridKV). A restored state continues exactly as the computed one (the same logit bits) and
as the float64 reference; checkpoints sit in spare state slots and give way to sequences; a
prompt's prefill stops at its last block boundary to leave one there, and a decode leaves one
every block; a hash collision never restores another prefix's state."""

from contextlib import contextmanager

import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from pyllama_paged.engine.kv.state_pool import split_budget
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.errors import PagedError
from pyllama_paged.testing.agreement import (assert_greedy_agree, assert_preempted_answers_agree,
                                              reference_next_logits)

BS = 16
# the checkpoints' bookkeeping does not depend on the layers: the MoE variant runs the tests
# that compare logits and answers (a restored state, sequences at once, a repeated prompt)
DENSE_ONLY = pytest.mark.parametrize("tiny_hybrid", ["qwen35"], indirect=True)
PROMPTS = [[int(x) for x in np.random.default_rng(70 + i).integers(4, 480, size=n)]
           for i, n in enumerate([40, 48, 33, 57, 21, 64, 45, 30])]


@contextmanager
def runner_for(model, state_slots=1, state_checkpoints=1, num_blocks=64):
    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=64, block_size=BS, num_blocks=num_blocks,
                                             state_slots=state_slots, state_checkpoints=state_checkpoints))
    try:
        yield runner
    finally:
        runner.close()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / (want.max() - want.min()))


def computed(runner, prompt, chunks):
    """A new sequence of prompt (taking what the cache gives) computed in chunks of the given
    ends; returns (the sequence, the last logits row)."""
    seq = runner.add_sequence_cached(prompt)
    logits = None
    for end in chunks:
        if end <= seq.num_computed:
            continue
        runner.append_tokens(seq, prompt[seq.num_tokens:end])
        logits = runner.step([(seq, end - seq.num_computed)])[-1].copy()
    return seq, logits


# ---- the runner: save, restore, give way --------------------------------------------------

def test_a_restored_state_continues_as_the_computed_one(tiny_hybrid):
    model, ref, _ = tiny_hybrid
    prompt = PROMPTS[0]
    with runner_for(model) as runner:
        kv = runner.kv
        a, want = computed(runner, prompt, [32, 40])   # a checkpoint after 2 blocks
        assert kv.num_checkpoints == 1 and kv.checkpoint_saves == 1
        runner.free(a)
        b, got = computed(runner, prompt, [40])
        assert (kv.checkpoint_hits, kv.checkpoint_hit_tokens) == (1, 32)
        np.testing.assert_array_equal(got, want)
        assert relative_error(got, ref.forward(prompt)[-1]) < 1e-3
        runner.free(b)
        # a prompt sharing the checkpointed blocks and then going elsewhere restores it too
        other = prompt[:35] + PROMPTS[1][:10]
        c, got = computed(runner, other, [len(other)])
        assert c.num_computed == len(other) and kv.checkpoint_hits == 2
        assert relative_error(got, ref.forward(other)[-1]) < 1e-3
        runner.free(c)


@DENSE_ONLY
def test_the_last_free_slot_takes_the_checkpoint_over(tiny_hybrid):
    """One running slot and one for checkpoints, both taken (one by another sequence, one by
    the checkpoint): the new sequence takes the checkpoint's slot as its own state."""
    model, _, _ = tiny_hybrid
    prompt = PROMPTS[0]
    with runner_for(model) as runner:
        kv = runner.kv
        a, want = computed(runner, prompt, [32, 40])
        runner.free(a)
        other = runner.add_sequence_cached(PROMPTS[2])   # the free slot
        b, got = computed(runner, prompt, [40])
        assert kv.checkpoint_hits == 1 and kv.num_checkpoints == 0 and kv.states.num_free == 0
        np.testing.assert_array_equal(got, want)
        runner.free(b)
        runner.free(other)
        assert kv.states.num_free == kv.states.num_slots


@DENSE_ONLY
def test_a_sequence_takes_a_checkpoints_slot_when_none_is_free(tiny_hybrid):
    model, _, _ = tiny_hybrid
    with runner_for(model) as runner:
        kv = runner.kv
        a, _ = computed(runner, PROMPTS[0], [32, 40])
        runner.free(a)
        seqs = [runner.add_sequence_cached(p) for p in PROMPTS[2:4]]
        assert kv.num_checkpoints == 0 and all(s.num_computed == 0 for s in seqs)
        with pytest.raises(PagedError, match="state slots are taken"):
            runner.add_sequence_cached(PROMPTS[4])
        for s in seqs:
            runner.free(s)


@DENSE_ONLY
def test_a_sequence_keeps_its_prompts_checkpoint_and_its_latest(tiny_hybrid):
    """Chunks ending at blocks 1 and 2, the prompt's last full block 2 (as the scheduler
    asks, aligned_chunk): that checkpoint stays; the decodes' at blocks 3 and 4 replace block
    1's and each other, so two slots hold what a finished request leaves."""
    model, _, _ = tiny_hybrid
    prompt = PROMPTS[5]   # 64 tokens
    with runner_for(model, state_checkpoints=2) as runner:
        kv = runner.kv
        a = runner.add_sequence_cached(prompt[:40])
        assert kv.aligned_chunk(0, 40, 40, a.handle) == 32
        runner.append_tokens(a, prompt[:16])
        runner.step([(a, 16)])
        runner.append_tokens(a, prompt[16:40])
        runner.step([(a, 16)])
        runner.step([(a, 8)])
        assert kv.checkpoint_saves == 2 and kv.num_checkpoints == 2   # blocks 1 (the latest) and 2
        for end in range(41, 65):   # one token at a time, as decodes: blocks 3 and 4
            runner.append_tokens(a, prompt[end - 1:end])
            runner.step([(a, 1)])
        assert kv.checkpoint_saves == 4 and kv.num_checkpoints == 2
        runner.free(a)
        # the prompt's at 2 blocks; the decodes' at 4 (a prompt reaches it with a token more)
        hits = [computed(runner, p, [len(p)])[0] for p in (prompt[:33], prompt[:64], prompt + [5])]
        assert [s.num_computed for s in hits] == [33, 64, 65]
        assert kv.checkpoint_hit_tokens == 32 + 32 + 64
        # without the scheduler's mark every checkpoint replaces the sequence's last
        for s in hits:
            runner.free(s)
        kv.drop_checkpoints()
        saves = kv.checkpoint_saves
        b, _ = computed(runner, prompt, [16, 32, 48])
        assert kv.checkpoint_saves == saves + 3 and kv.num_checkpoints == 1


@DENSE_ONLY
def test_a_hash_collision_never_restores_another_prefix(tiny_hybrid):
    """Block hashes cut to 1 bit: every block's key collides, the tokens kept with each
    checkpoint tell them apart."""
    model, ref, _ = tiny_hybrid
    with runner_for(model) as runner:
        kv = runner.kv
        kv.pool.weaken_hash(1)
        a, _ = computed(runner, PROMPTS[0], [32, 40])
        runner.free(a)
        other = PROMPTS[1][:40]
        b, got = computed(runner, other, [40])
        assert kv.checkpoint_hits == 0
        assert relative_error(got, ref.forward(other)[-1]) < 1e-3
        runner.free(b)


@DENSE_ONLY
def test_reset_prefix_cache_drops_every_checkpoint(tiny_hybrid):
    model, _, _ = tiny_hybrid
    with runner_for(model) as runner:
        a, _ = computed(runner, PROMPTS[0], [32, 40])
        runner.free(a)
        runner.kv.reset_prefix_cache()
        assert runner.kv.num_checkpoints == 0 and runner.kv.states.num_free == runner.kv.states.num_slots
        b, _ = computed(runner, PROMPTS[0], [40])
        assert b.num_computed == 40 and runner.kv.checkpoint_hits == 0


@DENSE_ONLY
def test_slabs_and_zero_checkpoint_slots_take_no_hit(tiny_hybrid):
    model, _, _ = tiny_hybrid
    with runner_for(model, state_checkpoints=0) as runner:
        assert not runner.kv.checkpoints_on and runner.kv.states.num_slots == 1
        a, _ = computed(runner, PROMPTS[0], [32, 40])
        runner.free(a)
        assert runner.add_sequence_cached(PROMPTS[0]).num_computed == 0
    runner = ModelRunner(model, EngineConfig(paged=False, n_ctx=128, n_threads=2, state_slots=2, state_checkpoints=2))
    try:
        assert not runner.kv.checkpoints_on and runner.kv.states.num_slots == 2
    finally:
        runner.close()


def test_aligned_chunks():
    class Pages:
        paged, block_size = True, 16

    class States:
        num_slots = 3

    from pyllama_paged.engine.kv.state_pool import HybridKV
    kv = HybridKV(Pages(), States(), checkpoint_slots=1)
    assert kv.aligned_chunk(0, 100, 100) == 96     # the last chunk stops at the prompt's last full block
    assert kv.aligned_chunk(96, 4, 100) == 4
    assert kv.aligned_chunk(0, 40, 100) == 32      # a chunk that does not end the prompt ends at a block
    assert kv.aligned_chunk(32, 10, 100) == 10     # unless that leaves it nothing
    assert kv.aligned_chunk(0, 15, 15) == 15       # a prompt inside one block
    assert kv.aligned_chunk(0, 33, 33) == 32
    with pytest.raises(PagedError, match="no state slot"):
        HybridKV(Pages(), States(), checkpoint_slots=3)
    every = HybridKV(Pages(), States(), checkpoint_slots=1, checkpoint_every=2)   # and every 32 tokens
    assert [every.aligned_chunk(c, 100 - c, 100) for c in (0, 32, 64, 96)] == [32, 32, 32, 4]
    assert every.aligned_chunk(0, 20, 100) == 16


def test_the_budget_pays_for_the_checkpoints():
    state = 1000
    assert split_budget(100 * state, state, 1, 64, 2) == (48, 2, 50 * state)   # half the budget: 50 slots
    assert split_budget(100 * state, state, 1, 4, 2) == (4, 2, 94 * state)     # max_num_seqs running
    assert split_budget(8 * state, state, 1, 64, 2) == (2, 2, 4 * state)       # share 4: 2 + 2
    assert split_budget(8 * state, state, 3, 64, 2) == (3, 2, 3 * state)       # n_seq_max first
    with pytest.raises(PagedError, match="2 of them for prefix-cache checkpoints"):
        split_budget(3 * state, state, 1, 64, 2)


# ---- the engine ---------------------------------------------------------------------------

@contextmanager
def engine(model, eot, state_checkpoints=2, state_slots=4, num_blocks=200, budget=64, mode="recompute"):
    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=budget, block_size=BS,
                                             num_blocks=num_blocks, state_slots=state_slots,
                                             state_checkpoints=state_checkpoints))
    try:
        yield LLMEngine(runner, eot, SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode))
    finally:
        runner.close()


def generate(llm, prompt, max_tokens=12):
    """(token ids, their log-probabilities) of a greedy answer to prompt alone on llm."""
    req = llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1,
                                                 ignore_eos=True))
    ids, logprobs = [], []
    while llm.has_work():
        for out in llm.step():
            assert out.request_id == req.request_id and out.error is None
            ids += [ev.token_id for ev in out.events]
            logprobs += [ev.logprob for ev in out.events]
    return ids, logprobs


def test_a_repeated_prompt_hits_its_prefill_checkpoint(tiny_hybrid):
    """The prefill of 48 tokens stops at 32 (the last block a later prompt can hit), which
    the second request restores: the same tokens and log-probability bits as without."""
    model, ref, eot = tiny_hybrid
    prompt = PROMPTS[1]
    with engine(model, eot, state_checkpoints=0) as llm:
        want = generate(llm, prompt)
    with engine(model, eot) as llm:
        first = generate(llm, prompt)
        second = generate(llm, prompt)
        stats = llm.stats()
        assert stats["state_checkpoint_hits"] == 1 and stats["state_checkpoint_hit_tokens"] == 32
        assert stats["prefix_cache_hits"] > 0 and llm.scheduler.prefix_hit_tokens == 32
        assert stats["state_slots_used"] == 0 and stats["state_checkpoints"] <= 2
    assert first == want and second == want
    assert_greedy_agree(prompt, ref.generate_greedy(prompt, 12), want[0], reference_next_logits(ref), eot)


@DENSE_ONLY
def test_a_second_turn_resumes_at_the_first_answers_last_block(tiny_hybrid):
    """Turn 1 (33 prompt tokens, 20 answered) leaves a decode checkpoint at 48; turn 2 (turn 1
    and its answer and 3 more tokens) resumes there."""
    model, ref, eot = tiny_hybrid
    prompt = PROMPTS[2]
    with engine(model, eot) as llm:
        answer, _ = generate(llm, prompt, max_tokens=20)
        turn2 = prompt + answer + [7, 8, 9]
        got = generate(llm, turn2)
        assert llm.stats()["state_checkpoint_hit_tokens"] == 48
    with engine(model, eot, state_checkpoints=0) as llm:
        assert generate(llm, turn2) == got
    assert_greedy_agree(turn2, ref.generate_greedy(turn2, 12), got[0], reference_next_logits(ref), eot)


def test_sequences_at_once_with_checkpoints_answer_as_the_reference(tiny_hybrid):
    """Eight requests, four running slots and two checkpoint slots, every prompt twice:
    checkpoints come and go between sequences, every answer is the reference's."""
    model, ref, eot = tiny_hybrid
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = PROMPTS[:4] * 2
    with engine(model, eot) as llm:
        reqs = [llm.add_request(p, params) for p in prompts]
        outs = {r.request_id: [] for r in reqs}
        while llm.has_work():
            for out in llm.step():
                outs[out.request_id] += [ev.token_id for ev in out.events]
        stats = llm.stats()
        assert stats["state_slots_used"] == 0 and stats["blocks_used"] == 0
        assert stats["state_checkpoint_saves"] > 0
    logits_of = reference_next_logits(ref)
    for p, r in zip(prompts, reqs):
        assert_greedy_agree(p, ref.generate_greedy(p, 8), outs[r.request_id], logits_of, eot)


@DENSE_ONLY
def test_preempted_requests_resume_from_their_checkpoints(tiny_hybrid):
    """Six prompts of two blocks, eight pages: decodes growing into a third block preempt
    requests, which recompute from the checkpoint their decode left at 32 tokens."""
    model, ref, eot = tiny_hybrid
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[int(x) for x in np.random.default_rng(90 + i).integers(4, 480, size=n)]
               for i, n in enumerate([30, 29, 31, 28, 26, 30])]
    answers = [ref.generate_greedy(p, 12) for p in prompts]
    with engine(model, eot, num_blocks=8) as llm:
        assert_preempted_answers_agree(llm, prompts, params, ref, answers, eot)
        stats = llm.stats()
        assert stats["state_slots_used"] == 0 and stats["state_checkpoint_hits"] > 0


@contextmanager
def engine_every(model, eot, every):
    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=64, block_size=BS, num_blocks=64,
                                             state_slots=1, state_checkpoints=3, state_checkpoint_every=every))
    try:
        yield LLMEngine(runner, eot, SchedulerConfig(max_num_batched_tokens=64))
    finally:
        runner.close()


@DENSE_ONLY
def test_a_shared_system_prompt_hits_a_checkpoint_kept_every_n_blocks(tiny_hybrid):
    """Two prompts sharing their first 40 tokens: with a checkpoint kept every 2 blocks of a
    prefill the second restores the first's at 32 tokens; without, the first leaves only its
    prompt's last block (48) and its answer's, which the second does not share."""
    model, ref, eot = tiny_hybrid
    first = PROMPTS[3]                       # 57 tokens
    second = first[:40] + PROMPTS[4][:15]    # the same 40, then its own
    for every, hit in ((2, 32), (0, 0)):
        with engine_every(model, eot, every) as llm:
            generate(llm, first, max_tokens=4)
            got = generate(llm, second, max_tokens=8)
            assert llm.scheduler.prefix_hit_tokens == hit
            assert llm.stats()["state_checkpoint_hit_tokens"] == hit
        assert_greedy_agree(second, ref.generate_greedy(second, 8), got[0], reference_next_logits(ref), eot)
    with pytest.raises(PagedError, match="state_checkpoint_every must be >= 0"):
        EngineConfig(state_checkpoint_every=-1)


@DENSE_ONLY
def test_from_config_keeps_two_checkpoint_slots(tiny_hybrid):
    model, _, eot = tiny_hybrid
    config = EngineConfig(model_path=model.path, n_ctx=128, n_threads=2, block_size=BS)
    llm = LLMEngine.from_config(config, model=model, eot_ids=eot)
    try:
        stats = llm.stats()
        assert (stats["state_slots_total"], stats["state_slots_running"]) == (3, 1)
        assert llm.scheduler.max_num_seqs == 1
        prompt = PROMPTS[1]
        first, second = generate(llm, prompt), generate(llm, prompt)
        assert first == second and llm.stats()["state_checkpoint_hits"] == 1
    finally:
        llm.close()
    with pytest.raises(PagedError, match="state_checkpoints must be >= 0"):
        EngineConfig(state_checkpoints=-1)
