"""Speculative decoding on Qwen3.5/3.6 hybrids: every drafted token goes through the recurrent
state in the step that verifies it, so a rejected draft must not stay there. The state before
the step is kept (a free state slot, else a host copy) and put back on a rejection, the accepted
tokens then recomputed (spec_decode/verify.py's _roll_back). A scripted drafter proposes the
float64 reference's answer cut short and ended by a wrong token, in turns, so drafts are
accepted whole, in part and not at all; every answer stays the reference's, and nothing held
for a draft outlives its step."""

import warnings
from contextlib import contextmanager

import numpy as np
import pytest

from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig, SpeculativeConfig
from pyllama_paged.engine.spec_decode.draft import PromptLookupDrafter
from pyllama_paged.engine.spec_decode.verify import Speculator
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.testing.agreement import assert_greedy_agree, reference_next_logits, run_to_completion

PROMPTS = [[int(x) for x in np.random.default_rng(110 + i).integers(4, 480, size=n)]
           for i, n in enumerate([19, 26, 9, 37])]
MAX_TOKENS = 14


class ScriptedDrafter(PromptLookupDrafter):
    """Drafts the known answer of a sequence's prompt: by turns its next m tokens and then a
    wrong one (m = 0, 1, ... k), so a draft is rejected at its first token, in its middle, or
    accepted whole."""

    def __init__(self, config: SpeculativeConfig, answers: dict[tuple, list[int]], n_vocab: int):
        super().__init__(config)
        self.answers, self.n_vocab, self.turn = answers, n_vocab, 0

    def propose_many(self, wants, catch_up_budget=None):
        return [self._draft(list(token_ids), k) for _, token_ids, k in wants]

    def _draft(self, token_ids: list[int], k: int) -> list[int]:
        prompt = next(p for p in self.answers if list(p) == token_ids[:len(p)])
        true = self.answers[prompt][len(token_ids) - len(prompt):]
        m = self.turn % (k + 1)
        self.turn += 1
        draft = true[:m] + ([(true[m] + 1) % self.n_vocab] if m < len(true) else [])
        return draft[:k]


@pytest.fixture(scope="module")
def answers(tiny_hybrid):
    _, ref, _ = tiny_hybrid
    return {tuple(p): ref.generate_greedy(p, MAX_TOKENS) for p in PROMPTS}


@contextmanager
def speculating(model, eot, answers, state_checkpoints):
    """An engine of four running state slots (and state_checkpoints more) speculating with
    the scripted drafter, closed after the block."""
    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=64, block_size=16, num_blocks=64,
                                             state_slots=len(PROMPTS), state_checkpoints=state_checkpoints))
    try:
        llm = LLMEngine(runner, eot, SchedulerConfig(max_num_batched_tokens=64))
        config = SpeculativeConfig(num_draft_tokens=3, draft_token_cost=0)
        llm.use_speculator(Speculator(config, ScriptedDrafter(config, answers, model.config.n_vocab)))
        yield llm
    finally:
        runner.close()


@pytest.mark.parametrize("state_checkpoints", [2, 0], ids=["held-in-a-slot", "held-on-the-host"])
def test_rejected_drafts_roll_the_state_back(tiny_hybrid, answers, state_checkpoints):
    """Four requests at once; with no checkpoint slots every slot is a running sequence's, so
    the state before each draft is kept on the host."""
    model, ref, eot = tiny_hybrid
    with speculating(model, eot, answers, state_checkpoints) as llm:
        got, _ = run_to_completion(llm, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                 ignore_eos=True))
        stats = llm.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert stats["state_slots_used"] == 0 and stats["blocks_used"] == 0
        kv = llm.runner.kv
        assert kv.states.num_free + kv.num_checkpoints == kv.states.num_slots and not kv._held
    logits_of = reference_next_logits(ref)
    for prompt, answer in zip(PROMPTS, got):
        assert_greedy_agree(prompt, answers[tuple(prompt)], answer[0], logits_of, eot)


def test_a_config_speculates_on_a_hybrid(tiny_hybrid):
    """The engine a config builds keeps its speculator for a hybrid, with no warning, and a
    repetitive prompt's answer stays the reference's."""
    model, ref, eot = tiny_hybrid
    prompt = PROMPTS[0][:6] * 4
    config = EngineConfig(model_path=model.path, n_ctx=128, n_threads=2, block_size=16,
                          speculative=SpeculativeConfig(num_draft_tokens=3, draft_token_cost=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm = LLMEngine.from_config(config, model=model, eot_ids=eot)
    try:
        assert llm.speculator is not None
        (got,), _ = run_to_completion(llm, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        assert llm.stats()["state_slots_used"] == 0
    finally:
        llm.close()
    assert_greedy_agree(prompt, ref.generate_greedy(prompt, 10), got[0], reference_next_logits(ref), eot)
