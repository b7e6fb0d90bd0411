"""Qwen3.5/3.6 hybrids in the engine: each running sequence holds a recurrent state slot
beside its KV pages (engine/kv/state_pool.py's HybridKV). Concurrent sequences each answer as
the float64 reference does, n>1 samples fork the state with the pages, preemption (swap asked
or not) recomputes, an abort or a finish gives the slot back, a full state pool queues
requests and a request wider than the pool is refused; without checkpoint slots no
prefix-cache hit is taken (test_state_checkpoints.py has them), prefix tiers and swap are off
with a warning, and the KV budget in bytes pays for the slots."""

from contextlib import contextmanager

import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, LLMEngine, Model, SamplingParams, SchedulerConfig, SpeculativeConfig
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.agreement import (assert_forked_samples_agree, assert_greedy_agree,
                                              assert_preempted_answers_agree, reference_next_logits,
                                              run_to_completion)
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35

PROMPTS = [[int(x) for x in np.random.default_rng(30 + i).integers(4, 480, size=n)]
           for i, n in enumerate([5, 9, 17, 24, 33, 41, 48, 60])]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def answers(tiny_hybrid):
    _, ref, _ = tiny_hybrid
    return [ref.generate_greedy(p, GREEDY.max_tokens) for p in PROMPTS]


@contextmanager
def engine(model, eot, num_blocks=200, mode="recompute", budget=64, state_slots=16, max_num_seqs=64):
    """An engine over its own runner of model, closed after the block."""
    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=budget, block_size=16,
                                             num_blocks=num_blocks, state_slots=state_slots, state_checkpoints=0))
    try:
        yield LLMEngine(runner, eot, SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode,
                                                     max_num_seqs=max_num_seqs))
    finally:
        runner.close()


def assert_all_free(llm):
    assert llm.stats()["state_slots_used"] == 0 and llm.stats()["blocks_used"] == 0


def test_eight_sequences_at_once_each_answer_as_alone_and_as_the_reference(tiny_hybrid, answers):
    model, ref, eot = tiny_hybrid
    with engine(model, eot) as llm:
        got, _ = run_to_completion(llm, PROMPTS, GREEDY)
        assert llm.stats()["steps"] < sum(len(a) for a in answers)   # they ran together
        logits_of = reference_next_logits(ref)
        for prompt, want, answer in zip(PROMPTS, answers, got):
            assert_greedy_agree(prompt, want, answer[0], logits_of, eot)
        assert_all_free(llm)
        for prompt, together in zip(PROMPTS[:3], got[:3]):   # and each alone, on the same engine
            (alone,), _ = run_to_completion(llm, [prompt], GREEDY)
            assert_greedy_agree(prompt, alone[0], together[0], logits_of, eot)


def test_parallel_samples_fork_the_state(tiny_hybrid):
    """n=3 greedy samples fork the prompt's sequence after its prefill: pages shared, the
    recurrent state copied; each continues as the reference does."""
    model, ref, eot = tiny_hybrid
    with engine(model, eot) as llm:
        assert_forked_samples_agree(llm, PROMPTS[4], ref, eot)
        assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_recomputes_and_keeps_the_reference_answers(tiny_hybrid, answers, mode):
    """A pool of 12 pages for prompts of 237 tokens: requests are preempted; a hybrid's are
    recomputed from their first token (a fresh, zeroed slot) even where swap is asked."""
    model, ref, eot = tiny_hybrid
    with engine(model, eot, num_blocks=12, mode=mode) as llm:
        assert_preempted_answers_agree(llm, PROMPTS, GREEDY, ref, answers, eot)
        assert llm.scheduler.num_swaps == 0
        assert_all_free(llm)


def test_an_abort_gives_the_slot_back(tiny_hybrid):
    model, _, eot = tiny_hybrid
    with engine(model, eot) as llm:
        req = llm.add_request(PROMPTS[7], SamplingParams(max_tokens=50, temperature=0))
        other = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=50, temperature=0))
        for _ in range(3):
            llm.step()
        assert llm.stats()["state_slots_used"] == 2
        assert llm.abort(req.request_id)
        assert llm.stats()["state_slots_used"] == 1
        assert llm.abort(other.request_id)
        assert_all_free(llm)


def test_a_full_state_pool_queues_requests(tiny_hybrid, answers):
    """Two state slots under a limit of eight sequences: at most two run at once, the rest wait
    for a slot, and every answer is still the reference's."""
    model, ref, eot = tiny_hybrid
    with engine(model, eot, state_slots=2, max_num_seqs=8) as llm:
        requests = [llm.add_request(p, GREEDY) for p in PROMPTS[:5]]
        outputs = {r.request_id: [] for r in requests}
        waited = False
        while llm.has_work():
            for out in llm.step():
                outputs[out.request_id] += [ev.token_id for ev in out.events]
            stats = llm.stats()
            assert stats["state_slots_used"] <= 2 and stats["running_seqs"] <= 2
            waited |= stats["waiting_requests"] > 0
        assert waited and all(r.error is None for r in requests)
        for prompt, want, r in zip(PROMPTS, answers, requests):
            assert_greedy_agree(prompt, want, outputs[r.request_id], reference_next_logits(ref), eot)
        assert_all_free(llm)


def test_a_request_wider_than_the_state_pool_is_refused(tiny_hybrid):
    model, _, eot = tiny_hybrid
    with engine(model, eot, state_slots=2, max_num_seqs=8) as llm:
        wide = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.8, n=3))
        beams = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=4, beam_width=2))   # forks before pruning: 3
        fine = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, n=2))
        while llm.has_work():
            llm.step()
        for r in (wide, beams):
            assert r.error is not None and "recurrent state slots" in r.error
        assert fine.error is None and len(fine.seqs) == 2
        assert_all_free(llm)


def test_beam_search_runs_within_its_slots(tiny_hybrid):
    model, _, eot = tiny_hybrid
    with engine(model, eot, state_slots=3, max_num_seqs=8) as llm:
        r = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=5, beam_width=2))
        while llm.has_work():
            llm.step()
            assert llm.stats()["state_slots_used"] <= 3
        assert r.error is None
        assert_all_free(llm)


def test_a_repeated_prompt_takes_no_prefix_cache_hit_without_checkpoints(tiny_hybrid, answers):
    """The pages of a finished request stay cached, but with no checkpoint slots a hybrid's
    next request with the same prompt recomputes it (the state at the cached prefix is gone)
    and answers the same."""
    model, ref, eot = tiny_hybrid
    with engine(model, eot) as llm:
        for _ in range(2):
            (got,), _ = run_to_completion(llm, [PROMPTS[6]], GREEDY)
            assert_greedy_agree(PROMPTS[6], answers[6], got[0], reference_next_logits(ref), eot)
        assert llm.stats()["prefix_cache_hits"] == 0 and llm.scheduler.prefix_queried_tokens > 0


def test_the_kv_budget_pays_for_the_state_slots(tiny_hybrid):
    model, _, eot = tiny_hybrid
    state = model_state_bytes(model)
    budget = 64 * state
    config = EngineConfig(model_path=model.path, n_ctx=128, n_threads=2, kv_bytes=budget, n_seq_max=2,
                          speculative=SpeculativeConfig(),
                          scheduler=SchedulerConfig(max_num_seqs=8, preemption_mode="swap"))
    with pytest.warns(UserWarning, match="preemption recomputes instead of swapping for a hybrid model"):
        llm = LLMEngine.from_config(config, model=model, eot_ids=eot)
    try:
        stats = llm.stats()
        assert llm.speculator is not None   # test_qwen35_speculative.py: its rollback
        # half of the budget may buy slots (at most max_num_seqs, and 2 for checkpoints), the rest pages
        assert (stats["state_slots_total"], stats["state_slots_running"]) == (10, 8)
        assert llm.scheduler.max_num_seqs == 8 and stats["state_bytes_per_seq"] == state
        assert stats["state_pool_bytes"] + stats["kv_pool_bytes"] <= budget
        assert stats["kv_pool_bytes"] > budget - stats["state_pool_bytes"] - llm.runner.block_bytes
        (got,), _ = run_to_completion(llm, [PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0))
        assert len(got[0]) >= 1
    finally:
        llm.close()


def model_state_bytes(model) -> int:
    from pyllama_paged.engine.kv.state_pool import state_bytes_per_sequence
    return state_bytes_per_sequence(model.native)


def test_prompt_logprobs_of_a_hybrid_are_the_references(tiny_hybrid):
    """The direct scoring oracle (a fresh sequence, every position's logits) through the state slot."""
    from pyllama_paged.engine.prompt_logprobs import prompt_logprobs

    model, ref, eot = tiny_hybrid
    with engine(model, eot) as llm:
        got = prompt_logprobs(llm.runner, PROMPTS[5])
        logits = ref.forward(PROMPTS[5])
        want = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        lps = np.array([lp for lp, _ in got[1:]])
        expected = np.array([want[i, t] for i, t in enumerate(PROMPTS[5][1:])])
        assert np.abs(lps - expected).max() < 2e-2
        assert_all_free(llm)


def test_a_hybrid_draft_model_is_refused(tiny_hybrid, tmp_path):
    from pyllama_paged.errors import PagedError

    model, _, eot = tiny_hybrid
    config = EngineConfig(model_path=model.path, n_ctx=128, n_threads=2,
                          speculative=SpeculativeConfig(method="draft_model", draft_model=model.path))
    with pytest.raises(PagedError, match="is a hybrid"):
        LLMEngine.from_config(config, model=Model(write_tiny_model(tmp_path / "llama.gguf", "llama", n_layer=1,
                                                                   n_vocab=model.config.n_vocab)), eot_ids=eot)


def test_llama_api_and_http_server_answer_as_the_reference(tiny_hybrid):
    """Llama.generate gives the reference's greedy continuation; the same text comes back from
    Llama.create_completion, /v1/completions (the real openai client) and /api/generate of a
    real server."""
    import itertools

    from pyllama_paged.api.llama import Llama
    from pyllama_paged.testing.serving import assert_served_completion

    model, ref, eot = tiny_hybrid
    prompt = "The capital of France is"
    llm = Llama(model_path=model.path, n_ctx=128, n_threads=2, verbose=False)
    try:
        ids = llm.tokenize(prompt)
        got = list(itertools.islice(llm.generate(ids, temp=0), 8))
        assert_greedy_agree(ids, ref.generate_greedy(ids, 8), got, reference_next_logits(ref), eot)
        answer = list(itertools.takewhile(lambda t: t not in eot, got))
        text = llm.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
        assert text == llm.detokenize(answer, prev_tokens=ids).decode("utf-8", "replace")
    finally:
        llm.close()
    assert_served_completion(model.path, prompt, text)


@pytest.mark.parametrize("weight_type", ["q8_0", "f16"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_alone_and_together_are_the_same_bits(tmp_path, arch, weight_type):
    """docs/batch-invariance.md for hybrids: every request alone (one thread, one chunk), then
    all together (two threads, small chunks, a pool that preempts, decodes of many sequences in
    one delta-rule call): the same tokens and log-probability bits. A sequence's convolution and
    delta rule see only its own tokens and state, whatever shares the step."""
    from pyllama_paged.testing.invariance import compare, random_workload, run_alone, run_workload

    def params(i):   # answers long enough that decodes outgrow the small pool's pages
        if i % 2 == 0:
            return SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
        return SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1000 + i, logprobs=1, ignore_eos=True)

    def factory(threads, budget, blocks):
        def make():
            runner = ModelRunner(model, EngineConfig(n_ctx=256, n_threads=threads, n_batch=budget, block_size=16,
                                                     num_blocks=blocks, state_slots=24, state_checkpoints=0))
            return LLMEngine(runner, {0}, SchedulerConfig(max_num_batched_tokens=budget))
        return make

    model = Model(write_tiny_qwen35(tmp_path / f"{arch}.gguf", arch, weight_type=weight_type))
    try:
        workload = random_workload(16, (4, 480), params, seed=1)
        alone = run_alone(factory(1, 512, 400), workload)
        engine = factory(2, 37, 12)()
        try:
            got = run_workload(engine, workload)
            preemptions = engine.stats()["preemptions"]
        finally:
            engine.close()
        result = compare(alone, got)
        assert result.bit_identical == result.n, str(result)
        assert preemptions > 0   # the small pool did preempt
    finally:
        model.close()
