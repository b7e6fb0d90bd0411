"""Comparing greedy answers computed in different batch shapes.

GGML picks different matmul kernels for different batch shapes (and CPUs), so
the same greedy request run alone and run beside others may part where the two
best logits are nearly tied. These helpers accept a divergence only there: at
the first differing position both tokens must be within NEAR_TIE logits of the
best logit, recomputed for that prefix by a single-sequence prefill. After the
first divergence the two answers continue different texts and are not compared.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

# Logits. Batch-shape differences are rounding (a small fraction of a logit); a real bug
# (wrong KV, mixed-up sequences) moves logits by whole units.
NEAR_TIE = 0.5


def engine_logits(runner) -> Callable[[Sequence[int]], np.ndarray]:
    """logits_of(ids) for assert_greedy_agree: the next-token logits after ids,
    computed by a single-sequence prefill on runner."""

    def logits_of(ids):
        seq = runner.add_sequence(list(ids))
        try:
            return runner.prefill(seq)
        finally:
            runner.free(seq)

    return logits_of


def assert_greedy_agree(prompt: Sequence[int], expected: Sequence[int], got: Sequence[int],
                        logits_of: Callable[[Sequence[int]], np.ndarray], end_ids=(),
                        margin: float = NEAR_TIE) -> None:
    """expected and got are greedy continuations of prompt; they must be equal up to
    a near-tie (see the module docstring). An answer that ends early is taken to
    have chosen one of end_ids at that position."""
    expected, got = list(expected), list(got)
    n = min(len(expected), len(got))
    i = next((j for j in range(n) if expected[j] != got[j]), None)
    if i is None:
        if len(expected) == len(got):
            return
        i = n
    row = np.asarray(logits_of(list(prompt) + expected[:i]), dtype=np.float64)
    best = float(row.max())

    def gap(answer):
        if i < len(answer):
            return best - row[answer[i]]
        return min((best - row[t] for t in end_ids), default=np.inf)

    gaps = (gap(expected), gap(got))
    assert max(gaps) <= margin, (
        f"answers part at token {i} ({expected[i:i + 1]} vs {got[i:i + 1]}) where the logits are "
        f"{gaps[0]:.3f} and {gaps[1]:.3f} below the best: more than the {margin} of a near-tie")


def run_to_completion(llm, prompts, params):
    """Add each prompt as a request with params and step llm until none is left: per
    request, its token ids by sample index ({seq_index: [ids]}), and the requests."""
    requests = [llm.add_request(p, params) for p in prompts]
    outputs = {r.request_id: {} for r in requests}
    while llm.has_work():
        for out in llm.step():
            for ev in out.events:
                outputs[out.request_id].setdefault(ev.seq_index, []).append(ev.token_id)
    return [outputs[r.request_id] for r in requests], requests


def small_engine(model, end_ids, num_blocks: int = 200, mode: str = "recompute", budget: int = 64):
    """An LLMEngine on model for the fork and preemption checks: a context of 128, blocks of 16
    (num_blocks of them), two threads, budget tokens a step, preemption by mode."""
    from ..engine import EngineConfig, LLMEngine, SchedulerConfig
    from ..engine.worker.model_runner import ModelRunner

    runner = ModelRunner(model, EngineConfig(n_ctx=128, n_threads=2, n_batch=budget, block_size=16,
                                             num_blocks=num_blocks))
    return LLMEngine(runner, end_ids, SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode))


def reference_next_logits(ref) -> Callable[[Sequence[int]], np.ndarray]:
    """logits_of(ids) for assert_greedy_agree from a float64 reference model: its last row."""
    return lambda ids: ref.forward(ids)[-1]


def assert_forked_samples_agree(llm, prompt, ref, end_ids, n: int = 3, max_tokens: int = 16) -> None:
    """n greedy samples of prompt on llm share its pages and copy the partial last block on
    their first write (at least n - 1 copies); each continues as ref's greedy answer does, up
    to a near-tie, and every block is free afterwards."""
    from ..engine import SamplingParams
    (outs,), _ = run_to_completion(llm, [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, n=n))
    assert sorted(outs) == list(range(n)) and llm.stats()["cow_copies"] >= n - 1
    want = ref.generate_greedy(prompt, max_tokens)
    for answer in outs.values():
        assert_greedy_agree(prompt, want, answer, reference_next_logits(ref), end_ids)
    assert llm.stats()["blocks_used"] == 0


def assert_preempted_answers_agree(llm, prompts, params, ref, answers, end_ids) -> None:
    """prompts on llm, whose pool cannot hold them all at once: at least one preemption, each
    answer ref's greedy one (answers) up to a near-tie, every block free afterwards."""
    got, _ = run_to_completion(llm, prompts, params)
    assert llm.stats()["preemptions"] > 0
    logits_of = reference_next_logits(ref)
    for prompt, want, answer in zip(prompts, answers, got):
        assert_greedy_agree(prompt, want, answer[0], logits_of, end_ids)
    assert llm.stats()["blocks_used"] == 0
