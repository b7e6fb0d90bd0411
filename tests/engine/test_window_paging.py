"""Sliding-window layers give their pages back: the grouped block pool (one
block table per layer group, window groups freeing what no later query sees),
and the engine on it giving the same answers as without freeing."""

import numpy as np
import pytest

from pyllama_paged.engine.kv.block_pool import BlockPool, BlockState
from pyllama_paged.engine import EngineConfig, KVGroups, LLMEngine, SamplingParams, SchedulerConfig
from pyllama_paged.engine.kv.groups import first_needed_block, window_blocks_held
from pyllama_paged.engine.kv.manager import PagedKV
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.engine.kv.step_batch import StepBuffers
from pyllama_paged.testing.agreement import run_to_completion, assert_greedy_agree, engine_logits

BS = 4


def live(pool, seq, group):
    return [int(b) for b in pool.block_table(seq, group) if b >= 0]


def commit(kv, handle, start, count):
    items = np.array([[handle, start, count]], dtype=np.int32)
    kv.commit_batch(items)


# ---- layer groups ------------------------------------------------------------

def test_groups_cut_each_span_by_the_gcd_of_the_layer_counts():
    gemma = KVGroups.for_windows([512] * 5 + [0] + [512] * 5 + [0] + [512] * 5 + [0])   # Gemma 3 270M
    assert gemma.n_groups == 6 and gemma.layers_per_group == 3
    assert gemma.group_window == (0, 512, 512, 512, 512, 512)
    assert [gemma.layer_group[il] for il in (5, 11, 17)] == [0, 0, 0]   # the global layers together
    odd = KVGroups.for_windows([4096] * 3 + [0] * 2)                    # gcd 1: a group per layer
    assert odd.n_groups == 5 and odd.window_groups == 3
    assert KVGroups.for_windows([0, 0]).n_groups == 1
    assert KVGroups.for_windows([64, 64]).group_window == (64,)          # every layer windowed


def test_steady_bytes_stop_growing_past_the_window():
    g = KVGroups.for_windows([16] * 5 + [0])
    slot = 100
    short = g.steady_bytes(slot, BS, 8)
    assert short == 6 * 2 * BS * slot                                     # every group, 2 blocks
    a, b = g.steady_bytes(slot, BS, 400), g.steady_bytes(slot, BS, 800)
    assert b - a == 100 * BS * slot                                       # only the global group grows


# ---- the grouped pool ----------------------------------------------------------

def test_window_groups_give_back_what_no_later_query_sees():
    window = 8
    kv = PagedKV(200, BS, max_seq_len=256, groups=KVGroups((0, 1), (0, window)))
    handle, _ = kv.create(list(range(1, 2)))
    commit(kv, handle, 0, 1)
    for pos in range(1, 120):
        kv.append(handle, [pos % 50 + 1])
        commit(kv, handle, pos, 1)
        n = pos + 1
        assert len(live(kv.pool, handle, 0)) == -(-n // BS)               # full attention keeps all
        held = live(kv.pool, handle, 1)
        assert len(held) <= -(-window // BS) + 1                          # the window, plus a block
        # exactly the blocks a query at position n sees are kept
        first = max(0, n - window + 1) // BS
        assert first_needed_block(window, BS, n) == first                 # the engine's rule is the pool's
        assert len(held) <= window_blocks_held(window, BS, BS)
        table = kv.block_table(handle, 1)
        assert all(b < 0 for b in table[:first]) and all(b >= 0 for b in table[first:])
    stats = kv.pool.stats()
    assert stats.num_used == len(live(kv.pool, handle, 0)) + len(live(kv.pool, handle, 1))
    kv.free(handle)
    assert kv.pool.stats().num_used == 0
    kv.close()


def test_prefix_hit_across_the_window_edge_needs_only_the_window():
    window = 8
    kv = PagedKV(200, BS, max_seq_len=256, groups=KVGroups((0, 1), (0, window)))
    prompt = list(range(10, 50))                                          # 10 full blocks
    a, cached = kv.create(prompt)
    assert cached == 0
    commit(kv, a, 0, len(prompt))
    assert len(live(kv.pool, a, 1)) <= -(-window // BS) + 1
    kv.free(a)                                                            # full computed blocks stay cached
    b, cached = kv.create_cached(prompt + [7, 7])
    # the window group gave its early blocks back, but the hit needs only the window
    # of the first token computed again, so every full block of the prompt is a hit
    assert cached == len(prompt)
    first_needed = (cached - window + 1) // BS
    table = kv.block_table(b, 1)
    assert all(x < 0 for x in table[:first_needed]) and all(x >= 0 for x in table[first_needed:])
    assert list(kv.pool.tokens(b)) == prompt
    # a different prompt sharing only the first blocks: the window group's miss inside
    # the window limits the hit to where every group has what the next query sees
    other = prompt[:16] + [99] * 24
    c, cached_c = kv.create_cached(other)
    assert cached_c == 16
    kv.close()


def test_a_window_miss_inside_the_window_shortens_the_hit():
    window = 8
    pool = BlockPool(100, BS, (0, window))
    prompt = list(range(1, 33))                                           # 8 full blocks
    a, _ = pool.create_sequence(prompt)
    pool.mark_computed(a, 16)           # blocks 0-3 computed; the window group gives back 0 and 1
    assert list(pool.block_table(a, 1)[:2]) == [-1, -1]
    pool.free(a)
    assert pool.evict(2) == 2           # the oldest cached: the window group's blocks 0 and 1
    # a query at 4, 8 or 12 would need a window block that is gone: no hit at all
    b, cached = pool.create_cached(prompt[:12] + [5])
    assert cached == 0
    pool.free(b)
    # a query at 16 sees only blocks 2 and 3 of the window group: all 16 tokens hit
    c, cached = pool.create_cached(prompt[:16] + [5])
    assert cached == 16
    assert list(pool.block_table(c, 1)[:2]) == [-1, -1] and min(pool.block_table(c, 0)) >= 0
    pool.close()


def test_forks_and_copy_on_write_cover_every_group():
    kv = PagedKV(100, BS, max_seq_len=64, groups=KVGroups((0, 1, 2), (0, 8, 8)))
    parent, _ = kv.create(list(range(1, 11)))                             # 2 full blocks + 2 tokens
    commit(kv, parent, 0, 10)
    child = kv.fork(parent)
    copies = kv.append(child, [42])
    assert len(copies) == 3                                               # one per group
    assert {kv.pool.block_info(d).group for _, d in copies} == {0, 1, 2}
    for g in range(3):
        assert kv.block_table(child, g)[-1] != kv.block_table(parent, g)[-1]
    kv.free(parent)
    kv.free(child)
    assert kv.pool.stats().num_used == 0
    kv.close()


def test_a_step_over_a_released_block_is_refused():
    kv = PagedKV(100, BS, max_seq_len=64, groups=KVGroups((0, 1), (0, 4)))
    handle, _ = kv.create(list(range(1, 21)))
    commit(kv, handle, 0, 20)                                             # window group keeps block 4
    kv.append(handle, [3])
    buffers = StepBuffers()
    buffers.reserve(8, 1, kv.max_blocks_per_seq, kv.n_groups)
    from pyllama_paged.errors import NativeError
    with pytest.raises(NativeError, match="gave back"):
        kv.build_batch(buffers.items([(handle, 10, 11)]), buffers)     # queries at 10 need block 1..2
    n, _ = kv.build_batch(buffers.items([(handle, 20, 1)]), buffers)
    assert n == 1
    kv.close()


# ---- the engine ------------------------------------------------------------------

# the module's `model`: tests/engine/conftest.py's tiny Gemma 3 (5 of its 6 layers windowed to 16 tokens)


def runner_for(model, free, num_blocks=None, n_batch=64):
    return ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=n_batch, block_size=16,
                                           num_blocks=num_blocks, free_window_blocks=free))


def test_long_sequences_give_the_logits_they_give_without_freeing(model):
    """Several windows long: the freed pages were never read again."""
    prompt = list(np.random.default_rng(5).integers(4, 300, size=150))
    out = {}
    for free in (False, True):
        runner = runner_for(model, free)
        seq = runner.add_sequence_cached(prompt)
        rows = []
        tokens = list(prompt)
        while seq.num_computed < len(tokens):
            n = min(40, len(tokens) - seq.num_computed)
            if seq.num_tokens < seq.num_computed + n:
                runner.append_tokens(seq, tokens[seq.num_tokens:seq.num_computed + n])
            logits = runner.step([(seq, n)])
            if seq.num_computed == len(tokens) and len(tokens) < 230:
                rows.append(logits[0].copy())
                tokens.append(int(np.argmax(logits[0])))
        if free:
            held = [len([b for b in runner.kv.block_table(seq.handle, g) if b >= 0])
                    for g in range(runner.kv.n_groups)]
            assert held[0] == -(-len(tokens) // 16)                         # the global group: all
            assert max(held[1:]) <= 2 + 1                                   # window 16: two blocks + one
        out[free] = (np.array(rows), tokens)
        runner.close()
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=0, atol=1e-4)
    assert out[True][1] == out[False][1]


PROMPTS = [list(np.random.default_rng(i).integers(4, 300, size=n)) for i, n in enumerate([70, 17, 100, 48, 9, 60])]
GREEDY = SamplingParams(max_tokens=40, temperature=0)
EOT = {1}


def engine(model, free, num_blocks=None, mode="recompute", budget=64):
    return LLMEngine(runner_for(model, free, num_blocks, budget), EOT,
                     SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode))


run_all = run_to_completion


@pytest.fixture(scope="module")
def alone(model):
    out = []
    for p in PROMPTS:
        llm = engine(model, False)
        out.append(run_all(llm, [p], GREEDY)[0][0])
        llm.runner.close()
    return out


def assert_agree(model, got, alone):
    llm = engine(model, False)
    logits_of = engine_logits(llm.runner)
    for prompt, g, a in zip(PROMPTS, got, alone):
        assert set(g) == {0}
        assert_greedy_agree(prompt, a[0], g[0], logits_of, EOT)
    llm.runner.close()


def test_batched_requests_on_freed_windows_equal_each_alone(model, alone):
    llm = engine(model, True)
    got, _ = run_all(llm, PROMPTS, GREEDY)
    assert_agree(model, got, alone)
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempting_long_windowed_sequences_keeps_their_answers(model, alone, mode):
    # 60 small blocks: fewer than the six requests hold together
    llm = engine(model, True, num_blocks=60, mode=mode)
    got, _ = run_all(llm, PROMPTS, GREEDY)
    assert_agree(model, got, alone)
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_used"] == 0 and stats["blocks_free"] + stats["blocks_cached"] == 60
    llm.runner.close()


def test_a_shared_long_prefix_is_reused_across_the_window_edge(model):
    llm = engine(model, True)
    system = list(range(100, 180))                                   # 5 full blocks, past the window
    run_all(llm, [system + [5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    before = llm.num_computed_tokens
    run_all(llm, [system + [8, 9]], SamplingParams(max_tokens=2, temperature=0))
    assert llm.num_computed_tokens - before == 2 + 1                  # only the new tokens and a decode
    llm.runner.close()


def test_n_samples_and_beams_run_on_freed_windows(model):
    llm = engine(model, True)
    prompt = list(range(10, 90))
    sampled = SamplingParams(max_tokens=30, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, n=3)
    (outs,), _ = run_all(llm, [prompt], sampled)
    assert len(outs) == 3 and all(len(o) == 30 for o in outs.values())
    beams = SamplingParams(max_tokens=12, temperature=0, beam_width=3)
    (bouts,), (req,) = run_all(llm, [prompt], beams)
    assert req.error is None and bouts
    assert llm.stats()["blocks_used"] == 0
    llm.runner.close()


def test_the_portable_gather_path_reads_only_what_the_window_kept(model):
    """Pages gathered by slot then GGML's flash attention (the path for any backend): over
    several windows, with window pages given back, it agrees with our operator."""
    prompt = list(np.random.default_rng(9).integers(4, 300, size=120))
    out = {}
    for attention in ("kernel", "gather"):
        runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=1, n_batch=64, block_size=16,
                                                 attention=attention))
        seq = runner.add_sequence_cached(prompt)
        rows = []
        while seq.num_computed < len(prompt):
            n = min(37, len(prompt) - seq.num_computed)          # chunks that straddle blocks
            runner.append_tokens(seq, prompt[seq.num_tokens:seq.num_computed + n])
            rows.append(runner.step([(seq, n)]).copy())
        assert min(runner.kv.block_table(seq.handle, 1)) < 0    # window pages were given back
        out[attention] = np.concatenate([r for r in rows if len(r)])
        runner.close()
    err = np.abs(out["kernel"] - out["gather"]).max() / np.ptp(out["kernel"])
    assert err < 0.02, err


def test_an_unknown_attention_path_is_refused(model):
    from pyllama_paged.errors import PagedError
    with pytest.raises(PagedError, match="attention 'cuda' unknown"):
        ModelRunner(model, EngineConfig(n_ctx=64, n_threads=1, attention="cuda"))
