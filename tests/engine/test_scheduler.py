"""The scheduler alone, on a small PagedKV and no model: admission order, chunked
prefill, decodes first, preemption order, swaps and copy-on-write in the plan.
A step is carried out by hand (what the runner and sampler would do: the computed
tokens are marked, a sequence that reached its last token gets one more)."""

from __future__ import annotations

import pytest

from pyllama_paged.engine.kv.manager import PagedKV
from pyllama_paged.engine.sched.request import Request, RequestStatus, Sequence
from pyllama_paged.engine import MAX_SCORE_ROWS, Sampler, SamplingParams, SchedulerConfig, ScoreParams
from pyllama_paged.engine.sched.scheduler import Scheduler

BLOCK = 4


def make(num_blocks=16, budget=64, mode="recompute", max_num_seqs=64, block_bytes=0, **config):
    kv = PagedKV(num_blocks, BLOCK, max_seq_len=64)
    return Scheduler(kv, 64, SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode,
                                             max_num_seqs=max_num_seqs, watermark=0.0, **config),
                     block_bytes=block_bytes)


def request(sched: Scheduler, rid: str, n_prompt: int, arrival: float) -> Request:
    """A request whose prompt shares no prefix with another's (the prefix cache stays out)."""
    params = SamplingParams(max_tokens=8, temperature=0)
    first = 100 * (1 + int(arrival))
    r = Request(rid, list(range(first, first + n_prompt)), params, arrival=arrival)
    r.seqs = [Sequence(list(r.prompt_ids), n_prompt, Sampler(params))]
    sched.add(r)
    return r


def seqs_of(sched: Scheduler) -> dict[int, Sequence]:
    return {s.seq_id: s for r in sched.running for s in r.seqs}


def carry_out(sched: Scheduler, plan) -> None:
    """What the engine does after schedule(): the KV is computed (update_from_output),
    and a sequence whose last token was computed draws one more (a made-up token id)."""
    seqs = seqs_of(sched)
    sched.update_from_output(plan, seqs)
    for seq_id in plan.seq_ids:
        seq = seqs[seq_id]
        if seq.kv.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)


def work(plan) -> list[tuple[int, int]]:
    """(sequence id, tokens it computes) in batch order."""
    return list(zip(plan.seq_ids, plan.num_tokens))


def test_admission_is_first_come_first_served_within_the_pool():
    sched = make(num_blocks=6)
    a = request(sched, "a", 8, arrival=1.0)     # 2 blocks
    b = request(sched, "b", 12, arrival=2.0)    # 3 blocks
    c = request(sched, "c", 8, arrival=3.0)     # 2 more would pass the pool's 6
    plan = sched.schedule()
    assert plan.seq_ids == [a.seqs[0].seq_id, b.seqs[0].seq_id]
    assert [r.request_id for r in sched.running] == ["a", "b"] and list(sched.waiting) == [c]
    assert c.status == RequestStatus.WAITING


def test_long_prompts_are_prefilled_in_chunks_of_the_budget():
    sched = make(budget=8)
    r = request(sched, "long", 20, arrival=1.0)
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        chunks.append(plan.num_tokens)
        carry_out(sched, plan)
    assert chunks == [[8], [8], [4]]
    assert r.seqs[0].kv.num_computed == 20 and len(r.seqs[0].token_ids) == 21   # its first token drawn


def test_a_long_prefill_leaves_room_to_admit_a_request_that_arrives():
    # the next turn of a running chat must not wait for all of a long prompt's prefill
    # (noisy_neighbour's long prompt: a 3.9 s gap between two answers of another user)
    sched = make(num_blocks=32, budget=16, admission_reserve_tokens=4)
    long = request(sched, "long", 48, arrival=1.0)
    carry_out(sched, sched.schedule())
    assert long.seqs[0].kv.num_computed == 16   # alone, it takes the whole budget
    short = request(sched, "short", 4, arrival=2.0)
    plan = sched.schedule()
    assert work(plan) == [(long.seqs[0].seq_id, 12), (short.seqs[0].seq_id, 4)]
    carry_out(sched, plan)
    plan = sched.schedule()   # nobody waits: the long prefill has the budget again, beside a decode
    assert work(plan)[0] == (short.seqs[0].seq_id, 1) and work(plan)[1] == (long.seqs[0].seq_id, 15)


def test_decodes_come_first_and_cap_the_prefill_beside_them():
    sched = make(budget=6)
    old = request(sched, "old", 4, arrival=1.0)
    carry_out(sched, sched.schedule())            # prefilled; one token drawn
    new = request(sched, "new", 12, arrival=2.0)
    plan = sched.schedule()
    assert plan.num_decodes == 1 and work(plan)[0] == (old.seqs[0].seq_id, 1)
    assert work(plan)[1] == (new.seqs[0].seq_id, 5)                   # what the budget leaves
    assert plan.num_prefill_tokens == 5


def test_the_latest_arrival_is_preempted_when_decodes_run_out_of_blocks():
    sched = make(num_blocks=4)
    early = request(sched, "early", 7, arrival=1.0)
    late = request(sched, "late", 7, arrival=2.0)
    carry_out(sched, sched.schedule())            # both prefilled: 2 blocks each, full pool
    assert len(early.seqs[0].token_ids) == 8 and len(late.seqs[0].token_ids) == 8
    carry_out(sched, sched.schedule())            # 8 tokens each: the last slot of each block
    plan = sched.schedule()                       # the 9th token needs a new block for each
    assert late.status == RequestStatus.WAITING and late.num_preemptions == 1 and late.seqs[0].kv is None
    assert early.status == RequestStatus.RUNNING and plan.seq_ids == [early.seqs[0].seq_id]
    assert sched.num_preemptions == 1


def test_swap_mode_plans_host_copies_and_brings_them_back():
    sched = make(num_blocks=4, mode="swap", block_bytes=100)
    early = request(sched, "early", 7, arrival=1.0)
    late = request(sched, "late", 7, arrival=2.0)
    carry_out(sched, sched.schedule())
    carry_out(sched, sched.schedule())
    held = [int(b) for b in sched.kv.block_table(late.seqs[0].kv.handle, 0)]
    plan = sched.schedule()
    assert late.status == RequestStatus.SWAPPED and sched.swapped_bytes == 200
    assert {m.seq_id for m in plan.swap_out} == {late.seqs[0].seq_id}
    assert sorted(m.block_id for m in plan.swap_out) == sorted(held)         # these pages go to host
    copied = {(m.group, m.index) for m in plan.swap_out}                     # the engine's host copies
    carry_out(sched, plan)
    sched.remove(early)                                                      # frees the pool
    plan = sched.schedule()
    assert late.status == RequestStatus.RUNNING and sched.swapped_bytes == 0
    # its full first block stayed in the prefix cache: only the half-full one is written back
    assert len(plan.swap_in) == 1 and all((m.group, m.index) in copied for m in plan.swap_in)
    assert plan.resumed_seq_ids == [late.seqs[0].seq_id]
    table = [int(b) for b in sched.kv.block_table(late.seqs[0].kv.handle, 0)]
    assert len(table) == 2 and plan.swap_in[0].block_id == table[1]


def test_swap_space_full_recomputes_instead():
    sched = make(num_blocks=4, mode="swap", block_bytes=100, swap_space_bytes=150)
    request(sched, "early", 7, arrival=1.0)
    late = request(sched, "late", 7, arrival=2.0)
    carry_out(sched, sched.schedule())
    carry_out(sched, sched.schedule())
    plan = sched.schedule()
    assert late.status == RequestStatus.WAITING and not plan.swap_out and sched.swapped_bytes == 0


def test_a_shared_last_block_is_copied_before_it_is_written():
    sched = make()
    r = request(sched, "n2", 6, arrival=1.0)     # 1 full block + 2 tokens in a second
    carry_out(sched, sched.schedule())
    parent = r.seqs[0]
    child = Sequence(list(parent.token_ids), parent.num_prompt, Sampler(r.params), index=1)
    child.kv = type(parent.kv)(sched.kv.fork(parent.kv.handle), parent.kv.num_computed, parent.kv.num_tokens)
    r.seqs.append(child)
    child.token_ids[-1] = 8                       # the samples drew different tokens
    plan = sched.schedule()
    assert plan.seq_ids == [parent.seq_id, child.seq_id]
    # the first to write the shared half-full block keeps it; the other gets a copy
    assert len(plan.block_copies) == 1
    src, dst = plan.block_copies[0]
    tables = [sched.kv.block_table(s.kv.handle, 0) for s in (parent, child)]
    assert tables[0][0] == tables[1][0]           # the full block stays shared
    assert {src, dst} == {int(tables[0][1]), int(tables[1][1])}


def test_max_num_seqs_bounds_admission():
    sched = make(max_num_seqs=2)
    for i in range(3):
        request(sched, f"r{i}", 4, arrival=float(i))
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["r0", "r1"] and len(sched.waiting) == 1


def test_a_request_the_pool_can_never_hold_fails_alone():
    sched = make(num_blocks=2)
    too_long = request(sched, "too long", 30, arrival=1.0)
    assert too_long.status == RequestStatus.FINISHED and "does not fit" in too_long.error   # refused at once
    grows = request(sched, "grows", 7, arrival=2.0)    # fits, then its answer outgrows the pool
    failed = []
    for _ in range(4):
        plan = sched.schedule()
        failed += plan.failed_request_ids
        carry_out(sched, plan)
    assert grows.status == RequestStatus.FINISHED and "out of KV blocks" in grows.error
    assert failed == ["grows"] and not sched.has_work()
    assert sched.kv.pool.stats().num_free + sched.kv.pool.stats().num_cached == 2


@pytest.mark.parametrize("n_prompt", [1, 4, 5])
def test_an_empty_pool_admits_a_prompt_that_fits(n_prompt):
    sched = make(num_blocks=2)
    r = request(sched, "fits", n_prompt, arrival=1.0)
    plan = sched.schedule()
    assert work(plan) == [(r.seqs[0].seq_id, n_prompt)]


def test_schedule_moves_no_progress_and_update_from_output_does():
    sched = make(budget=8)
    r = request(sched, "r", 12, arrival=1.0)
    plan = sched.schedule()
    seq = r.seqs[0]
    assert seq.kv.num_computed == 0 and work(plan) == [(seq.seq_id, 8)] and plan.items == [(seq.kv.handle, 0, 8)]
    sched.update_from_output(plan, seqs_of(sched))
    assert seq.kv.num_computed == 8
    plan = sched.schedule()
    assert plan.items == [(seq.kv.handle, 8, 4)]


def test_scoring_takes_fresh_pages_a_capped_chunk_at_a_time():
    sched = make(budget=64, num_blocks=64)
    done = request(sched, "cached", 40, arrival=1.0)       # its prompt's full blocks enter the prefix cache
    carry_out(sched, sched.schedule())
    sched.remove(done)
    score = Request("score", list(done.prompt_ids), SamplingParams(), arrival=2.0, score=ScoreParams())
    score.seqs = [Sequence(list(score.prompt_ids), 40, Sampler(score.params))]
    sched.add(score)
    chunks = []
    while score.seqs[0].kv is None or score.seqs[0].kv.num_computed < 40:
        plan = sched.schedule()
        chunks.append(plan.num_tokens)
        carry_out(sched, plan)
    assert chunks == [[MAX_SCORE_ROWS], [40 - MAX_SCORE_ROWS]]   # no prefix-cache hit, at most 32 rows a step
