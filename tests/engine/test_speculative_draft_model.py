"""Speculative decoding with a draft model (spec_draft_model.py), on real GGUFs: the
default model drafting for itself (every greedy draft accepted, up to near-ties), a
small random-weight Gemma 3 with the same tokenizer drafting badly (the answer is the
target's all the same), the counts, n>1, grammars, preemption, aborts, the slab
baseline, the vocabulary check, and the draft pool left empty."""

import numpy as np
import pytest

from pyllama_paged.api.llama import Llama
from pyllama_paged.engine import (EngineConfig, LLMEngine, SamplingParams, SchedulerConfig, SpeculativeConfig,
                                  default_model_path)
from pyllama_paged.engine.spec_decode.draft_model import DraftModelDrafter
from pyllama_paged.errors import PagedError
from pyllama_paged.testing import synthetic_gguf, synthetic_presets
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
from pyllama_paged.testing.engine_runs import (chat_ids as _chat, digit_answers, greedy_with_and_without,
                                              run_together as _generate)

POEM = "Write a short poem about the sea and the wind."
FACTS = "List five facts about the planet Mars, one per line."


@pytest.fixture(scope="module")
def llm():
    """The default model, drafting for itself with a second copy of its own file."""
    with Llama(n_ctx=1024, n_threads=2,
               speculative={"draft_model": default_model_path(), "num_draft_tokens": 4}) as model:
        yield model


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A one-layer random-weight Gemma 3 with the default model's tokenizer: a poor drafter."""
    preset = synthetic_presets.shrink(synthetic_presets.get("gemma3-1.6b"), n_layer=1, n_ff=256)
    path = tmp_path_factory.mktemp("draft") / "draft.gguf"
    return synthetic_gguf.write(path, preset, seed=3)["path"]


def _engine(llm, draft_path, k=4, **config):
    spec = SpeculativeConfig(method="draft_model", draft_model=draft_path, num_draft_tokens=k)
    config = EngineConfig(**{"n_ctx": 512, "n_threads": 2, **config}, speculative=spec)
    return LLMEngine.from_config(config, model=llm._model, eot_ids=llm.llm_engine.eot_ids)


def _counts(engine):
    s = engine.stats()
    return np.array([s["spec_draft_tokens"], s["spec_accepted_tokens"], s["spec_drafts"], s["steps"]])


def _assert_settled(engine):
    """Both pools back: no target page and no draft page held, no draft sequence left."""
    s = engine.stats()
    assert s["blocks_used"] == 0 and s["blocks_free"] + s["blocks_cached"] == s["blocks_total"]
    assert s["spec_draft_blocks_used"] == 0 and s["spec_draft_sequences"] == 0


# ---- the config ----------------------------------------------------------------------
def test_config_forms():
    cfg = SpeculativeConfig.parse({"draft_model": "/x/draft.gguf", "num_draft_tokens": 3})
    assert (cfg.method, cfg.draft_model, cfg.num_draft_tokens) == ("draft_model", "/x/draft.gguf", 3)
    for bad in ({"method": "draft_model"}, {"method": "prompt_lookup", "draft_model": "/x/draft.gguf"},
                {"draft_model": "/x/d.gguf", "draft_kv_tokens": 0}):
        with pytest.raises(PagedError):
            SpeculativeConfig.parse(bad)


# ---- the default model drafting for itself ---------------------------------------------
def test_a_copy_of_the_target_drafts_every_greedy_token(llm):
    engine = llm.llm_engine
    assert isinstance(engine.speculator.drafter, DraftModelDrafter)
    prompt = _chat(llm, POEM)
    before = _counts(engine)
    plain, fast = greedy_with_and_without(engine, prompt, 64, ignore_eos=True)
    drafted, accepted, drafts, steps = _counts(engine) - before
    assert_greedy_agree(prompt, plain, fast, engine_logits(llm.runner), engine.eot_ids)
    # the same weights argue only at near-ties (other batch shapes round differently)
    assert 0 < accepted <= drafted and accepted >= 0.9 * drafted, (accepted, drafted)
    # every step emits its accepted drafts and one token of the target's own (max_tokens bounds
    # each draft, eos is ignored): the prefill's token, then accepted + 1 per decode step; the
    # steps counted include the plain run's, one per token
    fast_steps = steps - len(plain)
    assert len(fast) == fast_steps + accepted and drafts <= fast_steps - 1
    assert engine.stats()["spec_draft_forward_seconds"] > 0
    _assert_settled(engine)


def test_drafts_past_the_sliding_window(llm):
    """A sequence growing past the 512-token window: its window groups give blocks back
    while the draft model drafts from the newest token (a regression: drafting once read
    that token's batch, which the pool refuses when a block its query saw is gone)."""
    engine = llm.llm_engine
    prompt = _chat(llm, "Repeat after me. " + POEM * 42)
    assert 440 < len(prompt) < 512
    plain, fast = greedy_with_and_without(engine, prompt, 120, ignore_eos=True)
    assert len(prompt) + len(fast) > 512 + 2 * 32
    assert_greedy_agree(prompt, plain, fast, engine_logits(llm.runner), engine.eot_ids)
    _assert_settled(engine)


def test_parallel_samples_and_a_grammar(llm):
    engine = llm.llm_engine
    poem, facts = _chat(llm, POEM), _chat(llm, FACTS)
    greedy = SamplingParams(max_tokens=24, temperature=0, speculative=False)
    [[plain_poem]], [[plain_facts]] = _generate(engine, [(poem, greedy)]), _generate(engine, [(facts, greedy)])
    before = _counts(engine)
    results = _generate(engine, [(poem, SamplingParams(max_tokens=24, temperature=0, n=2)),
                                 (facts, SamplingParams(max_tokens=24, temperature=0)),
                                 (poem, SamplingParams(max_tokens=24, temperature=0.8, n=2, seed=7))])
    assert (_counts(engine) - before)[1] > 0
    logits_of = engine_logits(llm.runner)
    for got in results[0]:
        assert_greedy_agree(poem, plain_poem, got, logits_of, engine.eot_ids)
    assert_greedy_agree(facts, plain_facts, results[1][0], logits_of, engine.eot_ids)
    assert len(results[2]) == 2 and all(0 < len(s) <= 24 for s in results[2])
    # a grammar the draft model knows nothing of: its drafts are checked like any other
    plain, fast = digit_answers(llm, engine, _chat(llm, "Write the number 12345 three times."), 16)
    assert plain == fast
    _assert_settled(engine)


def test_aborted_requests_free_their_draft_sequences(llm):
    engine = llm.llm_engine
    prompt = _chat(llm, POEM)
    requests = [engine.add_request(prompt, SamplingParams(max_tokens=200, temperature=0.7, seed=i, n=2))
                for i in range(2)]
    for _ in range(6):
        engine.step()
    assert engine.stats()["spec_draft_sequences"] > 0
    for request in requests:
        assert engine.abort(request.request_id)
    _assert_settled(engine)


# ---- a poor drafter, other pools --------------------------------------------------------
def test_a_random_draft_model_changes_nothing_but_speed(llm, random_draft):
    """Drafts that are mostly wrong: the answers are still the target's, the pool is
    too small for every request at once (preemption frees draft sequences too)."""
    prompts = [_chat(llm, f"Note {i}. {POEM}") for i in range(3)]
    need = -(-(max(len(p) for p in prompts) + 32) // 32) * llm.llm_engine.runner.kv.n_groups
    engine = _engine(llm, random_draft, k=2, num_blocks=2 * need)
    try:
        greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        alone = [_generate(engine, [(p, greedy)])[0][0] for p in prompts]
        added = [engine.add_request(p, greedy) for p in prompts]
        while engine.has_work():
            engine.step()
            # a preempted or finished sequence's draft sequence is gone by the next draft
            assert engine.speculator.drafter.num_sequences <= len(prompts)
        assert engine.stats()["preemptions"] > 0
        drafted, accepted, _, _ = _counts(engine)
        assert 0 <= accepted < drafted
        logits_of = engine_logits(engine.runner)
        for prompt, want, request in zip(prompts, alone, added):
            assert request.error is None
            assert_greedy_agree(prompt, want, request.seqs[0].output_ids, logits_of, engine.eot_ids)
        _assert_settled(engine)
    finally:
        engine.close()


def test_slab_target_with_a_draft_model(llm):
    engine = _engine(llm, default_model_path(), paged=False)
    try:
        prompt = _chat(llm, FACTS)
        plain, fast = greedy_with_and_without(engine, prompt, 40)
        assert _counts(engine)[1] > 0
        assert_greedy_agree(prompt, plain, fast, engine_logits(engine.runner), engine.eot_ids)
        s = engine.stats()
        assert s["blocks_used"] == 0 and s["spec_draft_blocks_used"] == 0
    finally:
        engine.close()


def test_a_draft_model_with_another_vocabulary_is_refused(llm, tiny_gguf_bytes, tmp_path):
    other = tmp_path / "tiny.gguf"
    other.write_bytes(tiny_gguf_bytes)
    with pytest.raises(PagedError, match="vocabulary") as error:
        _engine(llm, str(other))
    assert str(other) in str(error.value) and llm.model_path in str(error.value)
    with pytest.raises(PagedError, match="vocabulary"):
        Llama(n_ctx=256, n_threads=2, speculative={"draft_model": str(other)})


# ---- catching the draft model up on long prompts ------------------------------------------
class _DraftWatch:
    """Records, per draft call of the engine's real drafter, the catch-up budget it was
    given, the tokens its runner computed, each sequence's draft, and which sequences it
    left behind (wrapping the drafter's and its runner's own methods, which still run)."""

    def __init__(self, drafter):
        self.calls = []
        self._computed = 0
        propose, step = drafter.propose_many, drafter.runner.step

        def counted_step(work):
            self._computed += sum(n for _, n in work)
            return step(work)

        def watched_propose(wants, catch_up_budget=None):
            self._computed = 0
            drafts = propose(wants, catch_up_budget)
            self.calls.append({"budget": catch_up_budget, "computed": self._computed,
                               "charged": drafter.last_catch_up_tokens, "lagging": set(drafter.lagging),
                               "drafts": {seq_id: d for (seq_id, _, _), d in zip(wants, drafts)},
                               # after the call: 0 for a sequence whose draft saw every token
                               "lag": {seq_id: drafter.lag(seq_id, ids) for seq_id, ids, _ in wants}})
            return drafts

        drafter.runner.step, drafter.propose_many = counted_step, watched_propose


def test_long_prompts_catch_the_draft_model_up_within_the_prefill_budget(llm):
    """Two long prompts arrive beside a running stream (the draft model has seen neither):
    no step computes more catch-up tokens than the step's spare prefill budget, which the
    cap on prefill beside decodes bounds; a long sequence decodes without drafts until its
    draft sequence has every token, then drafts; the answers are the target's."""
    cap = 48
    engine = _engine(llm, default_model_path(), n_ctx=1024, kv_tokens=4096,
                     scheduler=SchedulerConfig(max_prefill_tokens_with_decodes=cap))
    try:
        drafter = engine.speculator.drafter
        watch = _DraftWatch(drafter)
        short = _chat(llm, POEM)
        longs = [_chat(llm, f"Note {i}. Repeat after me. " + text)
                 for i, text in enumerate((FACTS * 40, POEM * 36))]
        assert all(400 < len(p) < 600 for p in longs)
        # the running stream decodes one token a step, so that it runs through both prompts' catch-up
        running = engine.add_request(short, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                           speculative=False))
        while len(running.seqs[0].output_ids) < 2:
            engine.step()
        late = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for p in longs]
        long_ids = {r.seqs[0].seq_id for r in late}
        while engine.has_work():
            engine.step()
        assert all(r.error is None for r in [running, *late])

        calls = [call for call in watch.calls if call["drafts"]]   # steps with decodes wanting drafts
        for call in calls:
            budget = call["budget"]
            assert budget is not None and budget <= cap and call["charged"] <= budget, call
            drafted = [seq_id for seq_id, d in call["drafts"].items() if d]
            # only a sequence's own few newest tokens are computed outside the budget
            assert call["computed"] <= budget + drafter.free_lag * len(drafted), call
            for seq_id in drafted:
                assert call["lag"][seq_id] == 0 and seq_id not in call["lagging"], call
        for seq_id in long_ids:
            behind = [i for i, call in enumerate(calls) if seq_id in call["lagging"]]
            with_draft = [i for i, call in enumerate(calls) if call["drafts"].get(seq_id)]
            # a prompt of 400+ tokens takes several pieces, with no draft meanwhile
            assert len(behind) >= 400 // cap - 1 and with_draft and min(with_draft) > max(behind)
        # the draft model saw neither prompt: all of both came through the budget, spread over steps
        charged = sum(call["charged"] for call in watch.calls)
        assert charged >= sum(len(p) for p in longs) and engine.stats()["spec_draft_catch_up_tokens"] == charged

        # the answers without speculation, all three in one batch (another batch shape: near-ties may part)
        alone = _generate(engine, [(p, SamplingParams(max_tokens=r.params.max_tokens, temperature=0,
                                                      ignore_eos=True, speculative=False))
                                   for p, r in zip([short, *longs], [running, *late])])
        logits_of = engine_logits(engine.runner)
        for prompt, [want], request in zip([short, *longs], alone, [running, *late]):
            assert_greedy_agree(prompt, want, request.seqs[0].output_ids, logits_of, engine.eot_ids)
        _assert_settled(engine)
    finally:
        engine.close()
