"""The native batched sampler on hand-made logits and against a NumPy
reference of the same rules (pyllama_paged/testing/reference/sampling_reference.py)."""

import numpy as np
import pytest

from pyllama_paged.engine import BatchSampler, Sampler, SamplingParams
from pyllama_paged.errors import NativeError, PagedError
from pyllama_paged.testing.reference.sampling_reference import reference_probs


def draws(params, logits, n=400, history=()):
    """n draws from one sequence's sampler (its generator advancing), in one native call."""
    logits = np.ascontiguousarray(logits, dtype=np.float32).reshape(1, -1)
    sampler = Sampler(params)
    return [s.token for s in BatchSampler(logits.shape[1]).sample(logits, [(0, sampler, list(history))] * n)]


LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def test_greedy_and_top_k_1():
    assert set(draws(SamplingParams(temperature=0), LOGITS, 5)) == {0}
    assert set(draws(SamplingParams(temperature=1.0, top_k=1, min_p=0, top_p=1), LOGITS)) == {0}


def test_top_k_top_p_min_p_restrict_candidates():
    base = dict(temperature=1.0, min_p=0.0, top_p=1.0, top_k=0, seed=1)
    assert set(draws(SamplingParams(**base), LOGITS)) == {0, 1, 2, 3}
    assert set(draws(SamplingParams(**{**base, "top_k": 2}), LOGITS)) == {0, 1}
    assert set(draws(SamplingParams(**{**base, "top_p": 0.7}), LOGITS)) == {0, 1}
    assert set(draws(SamplingParams(**{**base, "min_p": 0.25}), LOGITS)) == {0, 1, 2}


def test_temperature_sharpens():
    base = dict(min_p=0.0, top_p=1.0, top_k=0, seed=2)
    hot = draws(SamplingParams(temperature=2.0, **base), LOGITS, 2000)
    cold = draws(SamplingParams(temperature=0.3, **base), LOGITS, 2000)
    assert hot.count(0) < cold.count(0)


def test_seed_reproduces():
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert draws(SamplingParams(seed=5, **p), LOGITS, 50) == draws(SamplingParams(seed=5, **p), LOGITS, 50)
    assert draws(SamplingParams(seed=5, **p), LOGITS, 50) != draws(SamplingParams(seed=6, **p), LOGITS, 50)


def test_a_seed_draws_the_same_whatever_else_is_in_the_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, seed=42)
    alone = [s.token for s in BatchSampler(300).sample(logits[2:3], [(0, Sampler(params), [])])]
    others = [(i, Sampler(SamplingParams(temperature=1.0, seed=i)), []) for i in range(5)]
    for n_threads in (1, 2, 3):   # and whichever thread draws it
        mixed = BatchSampler(300, n_threads).sample(logits, others[:3] + [(2, Sampler(params), [])] + others[3:])
        assert mixed[3].token == alone[0]


def test_penalties():
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    assert draws(SamplingParams(temperature=0, repeat_penalty=1.5), logits, 1, [0]) == [1]
    assert draws(SamplingParams(temperature=0, frequency_penalty=0.06), logits, 1, [0]) == [0]
    assert draws(SamplingParams(temperature=0, frequency_penalty=0.06), logits, 1, [0, 0]) == [1]
    assert draws(SamplingParams(temperature=0, presence_penalty=0.5), logits, 1, [0]) == [1]
    # a negative logit is multiplied (-1.0 -> -1.5): its probability under the native sampler
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5, seed=4)
    share = draws(params, logits, 40000, [2]).count(2) / 40000
    assert share == pytest.approx(np.exp(-1.5) / (np.exp(2.0) + np.exp(1.9) + np.exp(-1.5)), abs=0.004)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=5, top_p=0.5, min_p=0.0, repeat_penalty=1.3, presence_penalty=0.4,
         frequency_penalty=0.2),
])
def test_draws_follow_the_reference_distribution(kw):
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(2000) * 2.5).astype(np.float32)
    history = [int(t) for t in np.argsort(-logits)[:6]] * 2   # penalize some of the likeliest
    params = SamplingParams(seed=3, **kw)
    want = reference_probs(logits, history, params)
    n = 40000
    got = np.bincount(draws(params, logits, n, history), minlength=len(logits)) / n
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want))   # never outside the candidates
    assert np.abs(got - want).max() < 0.012                        # ~5 standard deviations at worst


def test_a_full_vocabulary_with_top_k_0_is_never_sorted_and_still_exact():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(262144) * 2).astype(np.float32)
    logits[:3] += 12   # a peaked head, as language models have
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0, seed=9)
    want = reference_probs(logits, [], params)
    got = draws(params, logits, 3000)
    assert all(want[t] > 0 for t in got)


def wide_row(seed, best_at):
    """A vocabulary-sized row, its likeliest tokens in one place and a lone peak at best_at:
    the sampler reads a row block by block, and the best token turning up late
    reweighs everything before it."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(262144).astype(np.float32)
    logits[best_at - 30:best_at] += 12
    logits[best_at] += 22   # far above the rest: top-k must look beyond its first margin
    return logits


def long_tail_row(seed):
    """A peak and 3,000 tokens each a 20,000th as likely that together hold 13% of the mass:
    a top-p 0.95 nucleus needs most of them (the candidate threshold is lowered)."""
    rng = np.random.default_rng(seed)
    logits = np.full(262144, -25.0, dtype=np.float32)
    logits[rng.choice(262144, 3000, replace=False)] = (-10 + 0.2 * rng.standard_normal(3000)).astype(np.float32)
    logits[77] = 0.0
    return logits


@pytest.mark.parametrize("row,kw", [
    ("wide", dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)),     # temperature alone: by partial masses
    ("wide", dict(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)),    # top-k widening its margin
    ("wide", dict(temperature=2.0, top_k=0, top_p=1.0, min_p=1e-6)),
    ("wide", dict(temperature=6.0, top_k=0, top_p=0.95, min_p=0.0)),    # a nucleus of most of the vocabulary
    ("tail", dict(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0)),    # the threshold lowered
])
@pytest.mark.parametrize("best_at", [31, 262143])
def test_wide_rows_follow_the_reference(row, kw, best_at):
    logits = wide_row(3, best_at) if row == "wide" else long_tail_row(best_at)
    params = SamplingParams(seed=8, **kw)
    want = reference_probs(logits, [], params)
    n = 1500 if kw["temperature"] >= 2 else 6000   # flat rows: every draw weighs most of the vocabulary
    got = np.bincount(draws(params, logits, n), minlength=len(logits)) / n
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want))
    assert np.abs(got - want).max() < (0.04 if n < 6000 else 0.02)
    if row == "tail":   # the tail's share, not only the peak's
        tail = np.flatnonzero(logits < -5)
        assert got[tail].sum() == pytest.approx(want[tail].sum(), abs=0.02)


def flat_row(seed):
    """A vocabulary-sized row with no peak: at temperature 1 a top-p 0.95 nucleus holds
    most of it, and a small top-p or a deep min-p holds a sliver of the mass."""
    return np.random.default_rng(seed).standard_normal(262144).astype(np.float32)


def rank_group_masses(probs, order, groups=20):
    """The probability mass of each of `groups` runs of tokens in `order`."""
    return np.array([probs[part].sum() for part in np.array_split(order, groups)])


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0),     # draws kept half the time; a huge nucleus
    dict(temperature=1.0, top_k=0, top_p=0.01, min_p=0.0),    # draws nearly never kept: the nucleus outright
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),    # min-p alone, deep in a flat row
    dict(temperature=1.0, top_k=3000, top_p=1.0, min_p=0.0),  # a k beyond the row's 1,024 blocks
])
def test_flat_rows_follow_the_reference(kw):
    logits = flat_row(6)
    params = SamplingParams(seed=12, **kw)
    want = reference_probs(logits, [], params)
    n = 1500 if kw["top_k"] else 6000   # a top-k this large heaps most of a flat row
    got = np.bincount(draws(params, logits, n), minlength=len(logits)) / n
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want))
    # no token is likely enough to test alone: compare the mass of runs of tokens, likeliest first
    kept = np.argsort(-want, kind="stable")[:np.count_nonzero(want)]
    assert np.abs(rank_group_masses(got, kept) - rank_group_masses(want, kept)).max() < (0.05 if n < 6000 else 0.025)


def test_top_k_in_a_row_with_fewer_live_blocks_than_k():
    # every token but 12 masked, all in the first of 1,024 blocks: the block maxima give no floor
    logits = np.full(262144, -np.inf, dtype=np.float32)
    logits[3:15] = np.linspace(0.0, 2.0, 12, dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0, seed=2)
    got = np.bincount(draws(params, logits, 4000), minlength=len(logits)) / 4000
    want = reference_probs(logits, [], params)
    assert set(np.flatnonzero(got)) <= set(range(3, 15))
    assert np.abs(got - want).max() < 0.03


def test_logprobs_of_a_penalized_wide_row_are_the_raw_distribution():
    logits = wide_row(4, 200000)
    want = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) - logits.max()
    params = SamplingParams(temperature=0.0, repeat_penalty=1e9, logprobs=5)
    got = BatchSampler(len(logits)).sample(logits.reshape(1, -1), [(0, Sampler(params), [200000])])[0]
    assert got.token != 200000                                   # the penalty moved the choice...
    assert got.logprob == pytest.approx(want[got.token], abs=1e-4)   # ...not the reported distribution
    assert list(got.top) == list(np.argsort(-want, kind="stable")[:5])
    assert list(got.top.values()) == pytest.approx(np.sort(want)[::-1][:5], abs=1e-4)


def test_a_top_k_beyond_the_vocabulary_keeps_every_token():
    # found by the HTTP fuzz: top_k = 2**40 overflowed the native int32 and failed the whole step
    got = draws(SamplingParams(temperature=1.0, top_k=2 ** 40, top_p=1.0, min_p=0.0, seed=1), LOGITS)
    assert set(got) == {0, 1, 2, 3}


def test_logprobs_only_for_rows_that_ask():
    logits = np.ascontiguousarray(np.stack([LOGITS, LOGITS]), dtype=np.float32)
    asked, plain = BatchSampler(4).sample(logits, [
        (0, Sampler(SamplingParams(temperature=0, logprobs=2)), []),
        (1, Sampler(SamplingParams(temperature=0)), [])])
    assert asked.token == 0 and asked.logprob == pytest.approx(np.log(0.5), abs=1e-5)
    assert list(asked.top) == [0, 1] and asked.top[1] == pytest.approx(np.log(0.3), abs=1e-5)
    assert plain.logprob is None and plain.top is None


def test_bad_rows_are_refused_before_anything_is_drawn():
    logits = np.zeros((1, 4), dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    before = sampler.rng_state.copy()
    with pytest.raises(NativeError, match="logit row"):
        BatchSampler(4).sample(logits, [(0, sampler, []), (3, sampler, [])])
    assert (sampler.rng_state == before).all()
    with pytest.raises(NativeError, match="history"):
        BatchSampler(4).sample(logits, [(0, Sampler(SamplingParams(temperature=0, repeat_penalty=1.2)), [7])])


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("min_p", 2),
                                         ("top_k", -1), ("logprobs", 50)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(PagedError, match=field):
        SamplingParams(**{field: value}).validate()


def test_more_threads_than_the_sampler_spreads_over_still_sample():
    """A host (or n_threads) past PP_SAMPLER_MAX_THREADS gets a sampler at the maximum,
    not an error (a 96-core host could not start the server)."""
    from pyllama_paged._native import lib
    from pyllama_paged.engine import BatchSampler, Sampler, SamplingParams
    sampler = BatchSampler(64, lib.PP_SAMPLER_MAX_THREADS + 32)
    logits = np.zeros((1, 64), dtype=np.float32)
    logits[0, 7] = 5.0
    assert sampler.sample(logits, [(0, Sampler(SamplingParams(temperature=0)), [])])[0].token == 7
    sampler.close()
