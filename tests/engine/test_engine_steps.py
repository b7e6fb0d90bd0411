"""The engine's step contract on a tiny model: scoring requests are scheduled like
any other (a chunk per step beside other users), their rows never shift another
request's logits row, and they free their pages."""

import numpy as np
import pytest

from pyllama_paged.engine import (MAX_SCORE_ROWS, EngineConfig, EngineLoop, LLMEngine, Model, SamplingParams,
                                  SchedulerConfig, ScoreParams)
from pyllama_paged.engine.prompt_logprobs import prompt_logprobs
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = Model(write_tiny_model(tmp_path_factory.mktemp("steps") / "llama.gguf", "llama", weight_type="q8_0"))
    config = EngineConfig(n_ctx=256, n_threads=1, n_batch=128, block_size=16, num_blocks=200,
                          scheduler=SchedulerConfig(max_num_batched_tokens=128))
    llm = LLMEngine.from_config(config, model=model, eot_ids={2})
    yield llm
    llm.close()
    model.close()


def run(llm, requests):
    """Step until every request finished; returns request id -> its outputs' events/result."""
    results = {r.request_id: {"tokens": [], "scores": None, "error": None} for r in requests}
    steps = 0
    while llm.has_work():
        for out in llm.step():
            got = results[out.request_id]
            got["tokens"] += [e.token_id for e in out.events]
            got["error"] = got["error"] or out.error
            if out.prompt_logprobs is not None:
                got["scores"] = out.prompt_logprobs
        steps += 1
    return results, steps


def assert_scores_agree(got, want):
    assert len(got) == len(want) and got[0] == (None, {})
    for (lp_a, top_a), (lp_b, top_b) in zip(got[1:], want[1:]):
        assert abs(lp_a - lp_b) < 1e-3
        # the same values at the top (the order of near-ties may differ between batch shapes)
        assert np.allclose(sorted(top_a.values()), sorted(top_b.values()), atol=1e-3)


def test_scoring_shares_steps_with_other_users_and_shifts_no_row(engine):
    prompt = [(7 * i) % 200 + 3 for i in range(150)]            # five chunks of at most 32 rows
    greedy = SamplingParams(max_tokens=20, temperature=0)
    alone = run(engine, [engine.add_request([5, 6, 7], greedy, "alone")])[0]["alone"]["tokens"]
    other_alone = run(engine, [engine.add_request([9, 10, 11, 12], greedy, "other alone")])[0]
    # scoring first, then a request admitted in the same step: its logits row comes after
    # the scoring chunk's 32 rows, and the decoding stream's row before them
    stream = engine.add_request([5, 6, 7], greedy, "stream")
    first = [e.token_id for out in engine.step() for e in out.events]   # prefilled: its first token
    scoring = engine.add_request(prompt, ScoreParams(top_n=3), "scoring")
    other = engine.add_request([9, 10, 11, 12], greedy, "other")
    results, steps = run(engine, [stream, scoring, other])
    assert steps >= -(-len(prompt) // MAX_SCORE_ROWS)
    assert not any(r["error"] for r in results.values())
    assert_scores_agree(results["scoring"]["scores"], prompt_logprobs(engine.runner, prompt, 3))
    logits_of = engine_logits(engine.runner)
    # each answer as given alone, up to near-ties (pyllama_paged/testing/agreement.py)
    assert_greedy_agree([9, 10, 11, 12], other_alone["other alone"]["tokens"], results["other"]["tokens"],
                        logits_of, {2})
    assert_greedy_agree([5, 6, 7], alone, first + results["stream"]["tokens"], logits_of, {2})
    assert engine.stats()["blocks_used"] == 0                     # scoring and generation gave pages back


def test_a_scoring_request_on_the_loop_and_its_abort(engine):
    loop = EngineLoop(engine)
    try:
        prompt = list(range(3, 120))
        outs = list(loop.submit(prompt, ScoreParams(top_n=2)))
        assert outs[-1].finished and outs[-1].prompt_logprobs is not None
        assert_scores_agree(outs[-1].prompt_logprobs, loop.call(lambda llm: prompt_logprobs(llm.runner, prompt, 2)))
        stream = loop.submit(list(range(3, 200)), ScoreParams())
        stream.abort()
        list(stream)
        assert loop.call(lambda llm: llm.stats()["blocks_used"]) == 0
    finally:
        loop.stop()


def test_score_params_are_checked():
    with pytest.raises(Exception, match="top_n"):
        ScoreParams(top_n=-1).validate()


def test_params_check_themselves_and_a_request_resolves_max_tokens_once(engine):
    # issue 50: SamplingParams is checked when made; the engine's own samplers (n>1 forks of the
    # last 64-bit seed, a beam's 2 x width log-probabilities) are made past the request's bounds
    with pytest.raises(Exception, match="temperature"):
        SamplingParams(temperature=-1)
    prompt = list(range(10, 30))
    forked = engine.add_request(prompt, SamplingParams(max_tokens=3, n=2, seed=2**64 - 1))
    beams = engine.add_request(prompt, SamplingParams(max_tokens=3, beam_width=16))
    to_the_context = engine.add_request(prompt, SamplingParams(max_tokens=0, temperature=0))
    assert (forked.max_len, beams.max_len, to_the_context.max_len) == (23, 23, engine.limit)
    engine.abort(to_the_context.request_id)
    results, _ = run(engine, [forked, beams])
    assert all(r["error"] is None for r in results.values())
    assert results[forked.request_id]["tokens"] and results[beams.request_id]["tokens"]
