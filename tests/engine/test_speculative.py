"""Speculative decoding by prompt lookup: the drafter, the draft tokens spliced into
a step, the verification rule's output distribution (exact figures against many
seeded draws through the real sampler), and the engine end to end on the default
model: greedy answers as without speculation (up to near-ties), n>1, grammars,
preemption, the pool left as it was."""

import numpy as np
import pytest

from pyllama_paged.api.llama import Llama
from pyllama_paged.engine import (BatchSampler, EngineConfig, LLMEngine, PromptLookupDrafter, Sampler,
                                  SamplingParams, SpeculativeConfig)
from pyllama_paged.engine.kv.manager import PagedKV, SeqState
from pyllama_paged.engine.sched.request import Request, Sequence
from pyllama_paged.engine.worker.draft_splice import block_room, splice_drafts
from pyllama_paged.engine.spec_decode.length import DraftLengths
from pyllama_paged.engine.spec_decode.verify import Speculator
from pyllama_paged.errors import PagedError
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
from pyllama_paged.testing.engine_runs import (chat_ids as _chat, digit_answers, greedy_with_and_without,
                                              run_together as _generate)

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
EDIT = f"Rename the parameter width to w in every function of this code and show the whole code:\n\n{CODE}"
SUMMARY = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog while the "
           "cat sleeps on the warm windowsill in the afternoon sun.")


# ---- the drafter ---------------------------------------------------------------
def test_drafter_follows_the_longest_latest_match():
    drafter = PromptLookupDrafter(SpeculativeConfig(num_draft_tokens=3, max_ngram=3))
    # suffix (7, 8, 9) occurs at 1 (followed by 1, 2, 3); the shorter (8, 9) later at 10 is not used
    history = [5, 7, 8, 9, 1, 2, 3, 4, 6, 6, 8, 9, 0, 7, 8, 9]
    assert drafter.propose(history) == [1, 2, 3]
    assert drafter.propose(history, 2) == [1, 2]
    # the latest occurrence wins among equal lengths
    assert drafter.propose([1, 2, 3, 1, 2, 4, 1, 2]) == [4, 1, 2]
    # a draft stops at the end of the history
    assert drafter.propose([4, 5, 4]) == [5, 4]


def test_drafter_without_a_match_drafts_nothing():
    drafter = PromptLookupDrafter(SpeculativeConfig(num_draft_tokens=4, max_ngram=3, min_ngram=2))
    assert drafter.propose([1, 2, 3, 4, 5, 1]) == []   # only a 1-gram repeats
    assert drafter.propose([]) == [] and drafter.propose([3]) == []
    assert drafter.propose([1, 2, 3, 1, 2], 0) == []


def test_draft_length_follows_acceptance():
    """Drafting pays while P(the first d tokens accepted) > one token's cost: a fresh
    sequence drafts on its prior, one whose drafts are rejected stops and probes again
    later, one whose drafts are accepted drafts all it may."""
    lengths = DraftLengths(token_cost=0.15)
    # prior a1 = 0.5, a2 = 0.8: 0.5, 0.4, 0.32, 0.256, 0.205, 0.164 pay; 0.131 does not
    assert lengths.length(1, 4) == 4 and lengths.length(1, 8) == 6
    for _ in range(10):
        lengths.observe(1, 4, 0)
    assert lengths.length(1, 4) == 0
    idle = 1
    while lengths.length(1, 4) == 0:
        idle += 1
        assert idle < 200, "a sequence that stopped drafting must probe again"
    assert idle > 10   # but not at once: a probe costs a row
    for _ in range(10):
        lengths.observe(2, 4, 4)
    assert lengths.length(2, 4) == 4 and min(lengths.rates(2)) > 0.85
    # copied runs: the first token often rejected, the rest accepted once one is
    for i in range(20):
        lengths.observe(3, 4, 4 if i % 2 else 0)
    a1, a2 = lengths.rates(3)
    assert 0.4 < a1 < 0.6 and a2 > 0.9 and lengths.length(3, 4) == 4
    lengths.forget([1, 2, 3])
    assert lengths.rates(1) == lengths.rates(99)
    assert DraftLengths(token_cost=0).length(5, 3) == 3   # cost 0: always the most
    with pytest.raises(PagedError):
        SpeculativeConfig(draft_token_cost=1.0)


def test_speculative_config_parses_every_surface_form():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(False) is None
    assert SpeculativeConfig.parse(True) == SpeculativeConfig()
    assert SpeculativeConfig.parse("prompt_lookup").method == "prompt_lookup"
    cfg = SpeculativeConfig.parse({"method": "prompt_lookup", "num_draft_tokens": 6, "max_ngram": 4})
    assert (cfg.num_draft_tokens, cfg.max_ngram) == (6, 4)
    for bad in ({"num_draft_tokens": 0}, {"method": "draft_model"}, {"max_ngram": 0}, {"bogus": 1}, 3):
        with pytest.raises(PagedError):
            SpeculativeConfig.parse(bad)


# ---- drafts in the flat batch ------------------------------------------------------
def test_splice_puts_drafts_after_their_item_in_the_same_block():
    # items: a 3-token prefill chunk (no logits row), a decode at position 9 (row 3), a decode at 4 (row 4)
    tok = np.array([10, 11, 12, 20, 30], dtype=np.int32)
    pos = np.array([0, 1, 2, 9, 4], dtype=np.int32)
    slots = np.array([100, 101, 102, 209, 304, 500, 501, 502, 609, 704], dtype=np.int32)   # two groups
    seqs = np.array([0, 0, 0, 1, 2], dtype=np.int32)
    rows = np.array([3, 4], dtype=np.int32)
    t, p, s, q, r, _ = splice_drafts(tok, pos, slots, seqs, rows, [3, 1, 1], {1: [21, 22], 2: [31]}, 2)
    assert t.tolist() == [10, 11, 12, 20, 21, 22, 30, 31]
    assert p.tolist() == [0, 1, 2, 9, 10, 11, 4, 5]
    assert s.tolist() == [100, 101, 102, 209, 210, 211, 304, 305, 500, 501, 502, 609, 610, 611, 704, 705]
    assert q.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert r.tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError):   # the prefill chunk computes no logits: it cannot carry a draft
        splice_drafts(tok, pos, slots, seqs, rows, [3, 1, 1], {0: [1]}, 2)
    assert block_room(9, 16) == 6 and block_room(15, 16) == 0


# ---- the verification rule -------------------------------------------------------
def _softmax(logits, temperature):
    x = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(x - x.max())
    return e / e.sum()


def test_verification_draws_the_targets_distribution():
    """Two rows, a one-token draft x: the first token must follow p0 (x accepted with
    p0(x), a rejection draws from p0 without x), and after an acceptance the bonus token
    follows p1. Figures from 6000 fixed seeds against the exact probabilities."""
    n_vocab, temperature, x = 6, 0.9, 2
    logits = np.array([[1.0, 0.2, 1.4, -0.5, 0.7, 0.0],
                       [0.3, 1.1, -0.2, 0.9, 0.0, 1.5]], dtype=np.float32)
    p0, p1 = _softmax(logits[0], temperature), _softmax(logits[1], temperature)
    sampler = BatchSampler(n_vocab)
    speculator = Speculator(SpeculativeConfig(num_draft_tokens=1))
    kv = PagedKV(num_blocks=8, block_size=16, max_seq_len=64)
    params = dict(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
    first, bonus = np.zeros(n_vocab), np.zeros(n_vocab)
    trials = 6000
    for seed in range(trials):
        prompt = [1, 3, 2]
        handle, _ = kv.create(prompt)
        seq = Sequence(list(prompt), len(prompt), Sampler(SamplingParams(seed=seed, **params)),
                       kv=SeqState(handle, 3, 3))
        request = Request("r", prompt, seq.sampler.params, seqs=[seq])
        emitted = []
        speculator.verify(sampler, logits.copy(), [(request, seq, 0, [x])],
                          lambda r, s, sampled: (emitted.append(sampled.token), s.token_ids.append(sampled.token)),
                          None, lambda r: True, kv, lambda copies: None)
        first[emitted[0]] += 1
        if emitted[0] == x:
            assert len(emitted) == 2 and seq.kv.num_computed == 4   # the accepted draft is placed and computed
            bonus[emitted[1]] += 1
        else:
            assert len(emitted) == 1 and seq.kv.num_computed == 3
        kv.free(handle)
    assert kv.pool.stats().num_used == 0
    assert speculator.num_draft_tokens == trials and speculator.num_accepted_tokens == first[x]
    # total variation within a bound that 6000 draws keep with overwhelming probability
    assert 0.5 * np.abs(first / trials - p0).sum() < 0.03
    assert 0.5 * np.abs(bonus / bonus.sum() - p1).sum() < 0.05


def test_greedy_verification_accepts_while_the_argmax_matches():
    sampler = BatchSampler(5)
    kv = PagedKV(num_blocks=4, block_size=16, max_seq_len=64)
    logits = np.full((4, 5), -1.0, dtype=np.float32)
    for row, best in enumerate([3, 1, 4, 0]):
        logits[row, best] = 2.0
    handle, _ = kv.create([0, 1])
    seq = Sequence([0, 1], 2, Sampler(SamplingParams(temperature=0)), kv=SeqState(handle, 2, 2))
    request = Request("r", [0, 1], seq.sampler.params, seqs=[seq])
    speculator = Speculator(SpeculativeConfig())
    emitted = []
    speculator.verify(sampler, logits, [(request, seq, 0, [3, 1, 2])],
                      lambda r, s, sampled: (emitted.append(sampled.token), s.token_ids.append(sampled.token)),
                      None, lambda r: True, kv, lambda copies: None)
    assert emitted == [3, 1, 4]           # two drafts accepted, the third replaced by the argmax
    assert seq.kv.num_computed == 4 and kv.pool.tokens(handle).tolist() == [0, 1, 3, 1]
    assert (speculator.num_draft_tokens, speculator.num_accepted_tokens) == (3, 2)


# ---- the engine on the default model ------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    with Llama(n_ctx=1024, n_threads=2, speculative={"num_draft_tokens": 5, "max_ngram": 3}) as model:
        yield model


def _spec_counts(engine):
    s = engine.stats()
    return s["spec_draft_tokens"], s["spec_accepted_tokens"]


def _assert_pool_settled(engine):
    """Every page back: none used, the rest free or cached."""
    s = engine.stats()
    assert s["blocks_used"] == 0 and s["blocks_free"] + s["blocks_cached"] == s["blocks_total"]


@pytest.mark.parametrize("text", [EDIT, SUMMARY], ids=["code-edit", "summary"])
def test_greedy_answers_as_without_speculation(llm, text):
    engine = llm.llm_engine
    prompt = _chat(llm, text)
    off = SamplingParams(max_tokens=80, temperature=0, speculative=False)
    on = SamplingParams(max_tokens=80, temperature=0)
    drafted0, accepted0 = _spec_counts(engine)
    [[plain]] = _generate(engine, [(prompt, off)])
    assert _spec_counts(engine) == (drafted0, accepted0)   # the opted-out request drafted nothing
    [[fast]] = _generate(engine, [(prompt, on)])
    drafted, accepted = (a - b for a, b in zip(_spec_counts(engine), (drafted0, accepted0)))
    assert 0 < accepted <= drafted, (accepted, drafted)
    assert_greedy_agree(prompt, plain, fast, engine_logits(llm.runner), engine.eot_ids)
    # the prefix cache now holds blocks that accepted drafts filled: a hit answers the same
    [[again]] = _generate(engine, [(prompt, on)])
    assert_greedy_agree(prompt, plain, again, engine_logits(llm.runner), engine.eot_ids)
    _assert_pool_settled(engine)


def test_seeded_sampling_draws_as_without_speculation(llm):
    """Each emitted token costs one draw of the sequence's generator, as without
    speculation: a seed gives the same answer (a float near a draw's boundary could
    still move it, so most of several seeds must agree in full)."""
    engine = llm.llm_engine
    prompt = _chat(llm, EDIT)
    same = 0
    for seed in range(3):
        params = dict(max_tokens=40, temperature=0.7, seed=seed)
        [[plain]] = _generate(engine, [(prompt, SamplingParams(speculative=False, **params))])
        [[fast]] = _generate(engine, [(prompt, SamplingParams(**params))])
        same += plain == fast
    assert same >= 2


def test_parallel_samples_and_other_requests_in_one_step(llm):
    engine = llm.llm_engine
    code, summary = _chat(llm, EDIT), _chat(llm, SUMMARY)
    greedy = SamplingParams(max_tokens=48, temperature=0, speculative=False)
    [[plain_code]], [[plain_summary]] = _generate(engine, [(code, greedy)]), _generate(engine, [(summary, greedy)])
    drafted0, _ = _spec_counts(engine)
    results = _generate(engine, [(code, SamplingParams(max_tokens=48, temperature=0, n=2)),
                                 (summary, SamplingParams(max_tokens=48, temperature=0)),
                                 (code, SamplingParams(max_tokens=48, temperature=0.8, n=3, seed=7))])
    assert _spec_counts(engine)[0] > drafted0
    logits_of = engine_logits(llm.runner)
    for got in results[0]:
        assert_greedy_agree(code, plain_code, got, logits_of, engine.eot_ids)
    assert_greedy_agree(summary, plain_summary, results[1][0], logits_of, engine.eot_ids)
    assert len(results[2]) == 3 and all(0 < len(s) <= 48 for s in results[2])
    _assert_pool_settled(engine)


def test_grammar_applies_to_drafts(llm):
    """A draft the grammar forbids is rejected: the copying prompt drafts prose, the
    grammar allows only digits, and the answer follows the grammar."""
    engine = llm.llm_engine
    prompt = _chat(llm, "Repeat 12345 12345 12345 12345 and then write the number 12345 again.")
    plain, fast = digit_answers(llm, engine, prompt, 40)
    assert plain == fast   # the mask and the argmax decide alike


def test_preempted_speculating_requests_finish_and_free_their_pages(llm):
    """A pool too small for every request at once: preemption drops drafts with the
    pages; every request still answers as alone, and no page is left held."""
    prompts = [_chat(llm, f"Note {i}. {SUMMARY}") for i in range(3)]
    tokens = max(len(p) for p in prompts) + 60
    probe = llm.llm_engine.runner.kv
    need = -(-tokens // probe.block_size) * probe.n_groups   # one request's pages
    config = EngineConfig(n_ctx=512, n_threads=2, num_blocks=2 * need, speculative=SpeculativeConfig())
    engine = LLMEngine.from_config(config, model=llm._model, eot_ids=llm.llm_engine.eot_ids)
    try:
        greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        alone = [_generate(engine, [(p, greedy)])[0][0] for p in prompts]
        results = _generate(engine, [(p, greedy) for p in prompts])
        assert engine.stats()["preemptions"] > 0 and _spec_counts(engine)[1] > 0
        for prompt, want, [got] in zip(prompts, alone, results):
            assert_greedy_agree(prompt, want, got, engine_logits(engine.runner), engine.eot_ids)
        _assert_pool_settled(engine)
    finally:
        engine.close()


def test_slab_baseline_speculates_too(llm):
    """paged=False: drafts go to the next slots of the sequence's own slab."""
    config = EngineConfig(n_ctx=512, n_threads=2, paged=False, speculative=SpeculativeConfig())
    engine = LLMEngine.from_config(config, model=llm._model, eot_ids=llm.llm_engine.eot_ids)
    try:
        prompt = _chat(llm, SUMMARY)
        plain, fast = greedy_with_and_without(engine, prompt, 40)
        assert _spec_counts(engine)[1] > 0
        assert_greedy_agree(prompt, plain, fast, engine_logits(engine.runner), engine.eot_ids)
        assert engine.stats()["blocks_used"] == 0
    finally:
        engine.close()


def test_api_calls_opt_out(llm):
    before = _spec_counts(llm.llm_engine)
    out = llm.create_completion(SUMMARY, max_tokens=12, temperature=0, speculative=False)
    assert out["choices"][0]["text"] and _spec_counts(llm.llm_engine) == before
    llm.create_chat_completion([{"role": "user", "content": SUMMARY}], max_tokens=24, temperature=0)
    assert _spec_counts(llm.llm_engine)[0] > before[0]
    with pytest.raises(PagedError):
        Llama(speculative={"num_draft_tokens": 0})


def test_stop_strings_cut_drafted_text_as_without_speculation(llm):
    """Several tokens may land in one step; text after a stop string is still dropped."""
    messages = [{"role": "user", "content": SUMMARY}]
    full = llm.create_chat_completion(messages, max_tokens=40, temperature=0, speculative=False)
    text = full["choices"][0]["message"]["content"]
    stop = text.split()[len(text.split()) // 2]   # a word from the middle of the answer
    answers = [llm.create_chat_completion(messages, max_tokens=40, temperature=0, stop=[stop], speculative=s)
               for s in (False, True)]
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert texts[0] == texts[1] == text[:text.index(stop)]
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["stop", "stop"]
