"""Alone against together: the same requests run one at a time on a quiet engine, then all
at once on an engine whose steps mix them (random arrival steps, chunk sizes, a pool small
enough to preempt), compared by their tokens and the bits of their log-probabilities.

What tests and bench/serving/batch_invariance.py share: a workload of prompts, the answers
an engine gives them, and the comparison. The engine is the caller's (a factory), so the
same workload runs on any model, weight type, pool, thread count or speculative setting."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from typing import Callable, Sequence

# One answer: per sample index, the (token id, log-probability) of every generated token;
# a beam search's ranked beams under BEAMS, as (output ids, score).
Answer = dict[int, list[tuple]]
BEAMS = -1


@dataclass
class Workload:
    """Prompts, each request's sampling parameters, and the step each request arrives at
    when they run together (alone, each arrives on a quiet engine)."""

    prompts: list[list[int]]
    params: list = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)


def random_workload(n_requests: int, vocab: tuple[int, int], params_for: Callable[[int], object],
                    seed: int = 0, prompt_len: tuple[int, int] = (3, 80), shared_prefix: Sequence[int] = (),
                    arrival_steps: int = 12) -> Workload:
    """n_requests prompts of random lengths (after an optional shared prefix), their
    parameters (params_for(i)), and random arrival steps in [0, arrival_steps)."""
    rng = random.Random(seed)
    prompts = [list(shared_prefix) + [rng.randrange(*vocab) for _ in range(rng.randrange(*prompt_len))]
               for _ in range(n_requests)]
    return Workload(prompts, [params_for(i) for i in range(n_requests)],
                    [rng.randrange(arrival_steps) for _ in range(n_requests)])


def run_workload(engine, workload: Workload, order: Sequence[int] | None = None) -> dict[int, Answer]:
    """Run the workload's requests on engine, each added at its arrival step (order: which
    requests, default all), to completion: request index -> its answer."""
    order = list(range(len(workload.prompts))) if order is None else list(order)
    pending = sorted(order, key=lambda i: workload.arrivals[i])
    answers: dict[int, Answer] = {}
    index_of: dict[str, int] = {}
    step = 0
    while pending or engine.has_work():
        while pending and workload.arrivals[pending[0]] <= step:
            i = pending.pop(0)
            request = engine.add_request(workload.prompts[i], workload.params[i])
            index_of[request.request_id] = i
            answers[i] = {}
        for out in engine.step():
            if out.error:
                raise AssertionError(f"request {index_of[out.request_id]} failed: {out.error}")
            answer = answers[index_of[out.request_id]]
            for ev in out.events:
                answer.setdefault(ev.seq_index, []).append((ev.token_id, ev.logprob))
            if out.beams:
                answer[BEAMS] = [(tuple(ids), score) for ids, score in out.beams]
        step += 1
    return answers


def run_alone(make_engine: Callable[[], object], workload: Workload) -> dict[int, Answer]:
    """Each request by itself on a fresh quiet engine."""
    answers = {}
    for i in range(len(workload.prompts)):
        engine = make_engine()
        try:
            answers.update(run_workload(engine, Workload(workload.prompts, workload.params, [0] * len(workload.prompts)),
                                        order=[i]))
        finally:
            engine.close()
    return answers


def _bits(logprob: float | None) -> bytes | None:
    return None if logprob is None else struct.pack("<d", logprob)


@dataclass
class Comparison:
    """How many answers kept their tokens, and their log-probabilities to the bit."""

    n: int
    same_tokens: int
    bit_identical: int
    mismatches: list[str]

    def __str__(self) -> str:
        head = f"{self.bit_identical}/{self.n} bit-identical, {self.same_tokens}/{self.n} same tokens"
        return head + "".join(f"\n  {m}" for m in self.mismatches[:8])


def compare(alone: dict[int, Answer], together: dict[int, Answer]) -> Comparison:
    """Answers compared request by request (every sample of each)."""
    same_tokens = identical = 0
    mismatches = []
    for i in sorted(alone):
        a, t = alone[i], together.get(i, {})
        tokens = {k: [tok for tok, _ in v] for k, v in a.items()} == {k: [tok for tok, _ in v] for k, v in t.items()}
        bits = tokens and all([_bits(lp) for _, lp in a[k]] == [_bits(lp) for _, lp in t[k]] for k in a)
        same_tokens += tokens
        identical += bits
        if not bits:
            mismatches.append(_first_difference(i, a, t))
    return Comparison(len(alone), same_tokens, identical, mismatches)


def _first_difference(i: int, a: Answer, t: Answer) -> str:
    for k in sorted(set(a) | set(t)):
        x, y = a.get(k, []), t.get(k, [])
        for j in range(max(len(x), len(y))):
            if j >= len(x) or j >= len(y) or x[j] != y[j]:
                return (f"request {i} sample {k} token {j}: alone {x[j] if j < len(x) else None}, "
                        f"together {y[j] if j < len(y) else None}")
    return f"request {i}: samples differ"
