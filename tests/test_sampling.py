"""Sampler behaviour on hand-made logits."""

import numpy as np
import pytest

from pyllama_paged.errors import PagedError
from pyllama_paged.engine.sampler import Sampler, SamplingParams, top_logprobs


def draws(params, logits, n=400, history=()):
    s = Sampler(params)
    return [s.sample(logits, list(history)) for _ in range(n)]


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


def test_penalties():
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.5))
    assert s.sample(logits, [0]) == 1
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.5))
    assert s.apply_penalties(logits, [2])[2] == pytest.approx(-1.5)
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.06))
    assert s.sample(logits, [0]) == 0 and s.sample(logits, [0, 0]) == 1
    s = Sampler(SamplingParams(temperature=0, presence_penalty=0.5))
    assert s.sample(logits, [0]) == 1


def test_logprobs():
    lp, top = top_logprobs(LOGITS, 1, 2)
    assert lp == pytest.approx(np.log(0.3), abs=1e-5)
    assert list(top) == [0, 1]


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("min_p", 2),
                                         ("top_k", -1), ("logprobs", 50)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(PagedError, match=field):
        SamplingParams(**{field: value}).validate()
