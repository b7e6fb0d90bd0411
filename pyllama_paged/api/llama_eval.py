"""llama-cpp-python's low-level token loop on the paged engine: eval(tokens) appends
tokens to the evaluated ones and computes the logits after them, sample(...) draws
the next token from those logits. Every eval is an ordinary one-token request to
the scheduler whose raw logits row is kept: the pool's prefix cache holds the
evaluated tokens' full pages, so an eval recomputes only the tokens past the last
full page, never the whole context."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..engine import BatchSampler, Sampler, SamplingParams
from ..errors import PagedError, RequestError


def logits_after(steps, ids: Sequence[int]) -> np.ndarray:
    """The raw logits row (float32) that follows ids, computed through the scheduler."""
    rows: list[np.ndarray] = []

    def keep(_history, row):
        rows.append(row.copy())   # the row is the runner's buffer, reused by the next step
        return row

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logits_processor=keep,
                            speculative=False)
    request = steps.add_request(list(ids), params)
    if request.error:
        raise RequestError(request.error)
    index = {request.request_id: 0}
    try:
        while not rows and (outputs := steps.next_outputs(index)):
            for out in outputs:
                if out.error:
                    raise RequestError(out.error)
                if out.finished:
                    index.pop(out.request_id, None)
    finally:
        steps.abort(request.request_id)
    if not rows:
        raise PagedError("the evaluation finished without logits")
    return rows[0]


class TokenSampler:
    """Llama.sample's state across calls: one random stream (so successive draws differ
    under one seed, as a llama.cpp sampler's do) and the grammar's state, which advances
    with each token drawn under that same grammar object."""

    def __init__(self, n_vocab: int, seed: int | None):
        self._batch = BatchSampler(n_vocab)
        self._stream = Sampler(SamplingParams(seed=seed))   # holds the random state
        self._grammar: Any = None
        self._constraint = None

    def close(self) -> None:
        """Free the native sampler."""
        self._batch.close()

    def sample(self, logits: np.ndarray, history: list[int], params: SamplingParams, grammar: Any,
               constraint_of) -> int:
        """One token from a copy of logits under params; history is what the penalties and
        a logits processor see. constraint_of(grammar) compiles a new grammar."""
        if grammar is not self._grammar:
            self._grammar = grammar
            self._constraint = None if grammar is None else constraint_of(grammar).start()
        sampler = Sampler(params)
        sampler.rng_state, sampler.rng_ptr = self._stream.rng_state, self._stream.rng_ptr
        sampler.constraint = self._constraint
        row = np.ascontiguousarray(logits, dtype=np.float32).copy()[None, :]
        [drawn] = self._batch.sample(row, [(0, sampler, history)])
        if drawn.error:
            raise RequestError(drawn.error)
        return drawn.token
