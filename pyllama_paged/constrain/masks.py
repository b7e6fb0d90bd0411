"""Token masks for every constrained row of a step, computed together."""

from __future__ import annotations

import os

import llguidance
import numpy as np

from .grammar import ConstraintState

_executor: llguidance.LLExecutor | None = None


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        # the engine's own threads run the model; the masks are computed while
        # they wait, so they may use the machine's cores
        _executor = llguidance.LLExecutor(num_threads=max(1, min(os.cpu_count() or 1, 8)))
    return _executor


class MaskBuffer:
    """Reused bitmask and byte-mask buffers for up to a batch of rows."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self.n_words = (n_vocab + 31) // 32
        self._bits = np.zeros((0, self.n_words), dtype=np.int32)

    def fill(self, states: list[ConstraintState]) -> np.ndarray:
        """uint8 [len(states), n_vocab]: 1 where a row's grammar allows the token (and, for
        JSON, its bound on a number's digits: digits.py)."""
        n = len(states)
        if self._bits.shape[0] < n:
            self._bits = np.zeros((n, self.n_words), dtype=np.int32)
        bits = self._bits[:n]
        _shared_executor().unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                                    bits.ctypes.data, self.n_words * 4, n)
        # one byte per token for the native sampler (0 masks it out)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=self.n_vocab, bitorder="little")
        for i, state in enumerate(states):
            admitted = state.digits.admits() if state.digits is not None else None
            if admitted is not None:   # a JSON number's run of digits is at its bound
                row = allowed[i, :len(admitted)]   # the model's rows past the tokenizer's: masked already
                np.bitwise_and(row, admitted[:len(row)], out=row)
        return allowed
