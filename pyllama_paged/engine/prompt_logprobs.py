"""Log-probabilities of a prompt's own tokens (OpenAI completions' echo with
logprobs, as lm-evaluation-harness asks for them): a prefill that keeps every
position's logits, a few rows at a time so a long prompt never holds a
[prompt, vocabulary] array."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .model_runner import ModelRunner
from .sampler import log_softmax

_ROWS = 32   # positions per forward: 32 x 262,144 floats is 32 MiB


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
    returns the list: EngineLoop.run_in_steps runs a step of everyone else's work between
    chunks, so scoring a long prompt never freezes the streams. Closing it early frees
    the sequence's pages."""
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
                                    list(range(n)))
            kv.mark_computed(seq.handle, max(seq.num_computed, start + n))
            seq.num_computed = max(seq.num_computed, start + n)
            for k in range(n):
                nxt = start + k + 1
                if nxt >= len(ids):
                    break
                lp = log_softmax(logits[k])
                top = {}
                if top_n > 0:
                    best = np.argpartition(-lp, top_n)[:top_n]
                    top = {int(t): float(lp[t]) for t in best[np.argsort(-lp[best])]}
                out.append((float(lp[ids[nxt]]), top))
            if start + n < len(ids):
                yield
    finally:
        runner.free(seq)
    return out
