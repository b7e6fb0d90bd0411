"""Embedding requests in the engine. A decoder model's embedding request is an
ordinary request to the scheduler that prefills (in chunks, beside other users'
decodes) and is never sampled: each step returns the final hidden states
(after the output norm) of the rows its pooling needs instead of logits, the
pooled vector is accumulated across chunks, and the request finishes, its
pages freed, when its last token is computed. Encoder models (bert) have an
engine of their own (encoder.py) that returns the same outputs.

Vectors leave the engine pooled but neither truncated nor normalized: that is
the API's business (embeddings.py at the package root)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import PagedError
from ..params import TOKEN_STATES


@dataclass(slots=True)
class _Pooled:
    total: np.ndarray | None = None    # float64 running sum (mean) or the chosen row (cls, last)
    count: int = 0
    rows: list = field(default_factory=list)   # TOKEN_STATES: every chunk's rows, in order


@dataclass
class DecoderPooling:
    """Running pooled states of the decoder embedding sequences in flight, by sequence id."""

    states: dict[int, _Pooled] = field(default_factory=dict)

    @staticmethod
    def rows_wanted(pooling: str, start: int, n: int, length: int) -> tuple[int, int]:
        """(first, count) of a chunk's tokens [start, start + n) of a length-token input that
        the pooling reads: mean all of them, cls position 0, last the final token."""
        if pooling in ("mean", TOKEN_STATES):
            return 0, n
        if pooling == "cls":
            return (0, 1) if start == 0 else (0, 0)
        return (n - 1, 1) if start + n == length else (0, 0)

    def add(self, seq_id: int, pooling: str, start: int, rows: np.ndarray) -> None:
        """Fold a chunk's hidden rows in; a chunk at position 0 starts afresh (a sequence
        preempted by recompute runs again from its start)."""
        state = self.states.get(seq_id)
        if state is None or start == 0:
            state = self.states[seq_id] = _Pooled()
        if not len(rows):
            return
        if pooling == TOKEN_STATES:
            state.rows.append(np.array(rows, dtype=np.float32))   # a copy: rows is the step's buffer
        elif pooling == "mean":
            chunk = rows.sum(axis=0, dtype=np.float64)
            state.total = chunk if state.total is None else state.total + chunk
            state.count += len(rows)
        else:
            state.total, state.count = rows[-1].astype(np.float64), 1

    def pop(self, seq_id: int) -> np.ndarray:
        """The pooled vector of a finished sequence (float32; TOKEN_STATES: n_tokens x n_embd),
        forgotten here."""
        state = self.states.pop(seq_id)
        if state.rows:
            return np.concatenate(state.rows)
        if state.total is None:
            raise PagedError("embedding finished without any pooled token state")
        return (state.total / max(state.count, 1)).astype(np.float32)

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
