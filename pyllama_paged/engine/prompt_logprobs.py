"""A prompt's own log-probabilities straight from a ModelRunner, without a
scheduler: for direct use and as the oracle of the engine's scoring requests
(scoring.py), which is what the server and the Python API use."""

from __future__ import annotations

from typing import Sequence

from .worker.model_runner import ModelRunner
from .params import MAX_SCORE_ROWS as _ROWS
from .scoring import score_rows


def prompt_logprobs(runner: ModelRunner, token_ids: Sequence[int],
                    top_n: int = 0) -> list[tuple[float | None, dict[int, float]]]:
    """(log-probability of token i given tokens < i, top_n best tokens there) per prompt
    token; the first has none. Call on the engine's thread, between steps: all at once."""
    chunks = score_prompt(runner, token_ids, top_n)
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def score_prompt(runner: ModelRunner, token_ids: Sequence[int], top_n: int = 0):
    """prompt_logprobs as a generator that yields after each chunk of _ROWS positions and
    returns the list (for EngineLoop.run_in_steps). Closing it early frees the
    sequence's pages."""
    ids = list(token_ids)
    # every position's logits are wanted: a sequence of fresh pages, nothing reused
    # from the prefix cache (whose window groups keep no early pages to start from)
    seq = runner.add_sequence_uncached(ids)
    out: list[tuple[float | None, dict[int, float]]] = [(None, {})]
    try:
        kv = runner.kv
        for start in range(0, len(ids), _ROWS):
            n = min(_ROWS, len(ids) - start)
            slots, tables = kv.batch_arrays(seq.handle, start, n)
            logits = runner.forward(ids[start:start + n], range(start, start + n), slots, [0] * n, tables,
                                    list(range(n)), state_slots=runner.state_slots_of(seq))
            kv.mark_computed(seq.handle, max(seq.num_computed, start + n))
            seq.num_computed = max(seq.num_computed, start + n)
            out += score_rows(logits, ids, start, top_n)
            if start + n < len(ids):
                yield
    finally:
        runner.free(seq)
    return out
