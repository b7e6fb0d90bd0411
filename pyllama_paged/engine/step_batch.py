"""A step's flat batch, the arrays the native forward step takes (tokens,
positions, slot mapping, sequence index, block tables, logit rows), held in
buffers reused from step to step and grown only when a step needs more."""

from __future__ import annotations

import numpy as np

from .._native import ffi


def _ptr(arr: np.ndarray, ctype: str = "int32_t *"):
    return ffi.cast(ctype, ffi.from_buffer(arr))


class StepBuffers:
    """Reused int32 buffers for one step's batch; `native` is the pp_step_buffers over them."""

    def __init__(self):
        self.native = ffi.new("pp_step_buffers *")
        self._tokens = np.empty(0, dtype=np.int32)          # token_ids, positions, slots, seq_index
        self._tables = np.empty(0, dtype=np.int32)
        self._rows = np.empty(0, dtype=np.int32)
        self._items = np.empty((0, 3), dtype=np.int32)
        self.max_blocks_per_seq = 1

    def reserve(self, n_tokens: int, n_items: int, max_blocks_per_seq: int) -> None:
        """Room for a step of n_tokens tokens over n_items sequences."""
        if n_tokens > self._tokens.shape[-1]:
            self._tokens = np.empty((4, max(n_tokens, 2 * self._tokens.shape[-1])), dtype=np.int32)
        if n_items * max_blocks_per_seq > self._tables.size:
            self._tables = np.empty(max(n_items * max_blocks_per_seq, 2 * self._tables.size), dtype=np.int32)
        if n_items > len(self._rows):
            self._rows = np.empty(max(n_items, 2 * len(self._rows)), dtype=np.int32)
            self._items = np.empty((len(self._rows), 3), dtype=np.int32)
        self.max_blocks_per_seq = max_blocks_per_seq
        b = self.native
        b.token_ids, b.positions, b.slot_mapping, b.seq_index = (_ptr(row) for row in self._tokens)
        b.block_tables = _ptr(self._tables)
        b.logit_rows = _ptr(self._rows)

    @property
    def capacity_tokens(self) -> int:
        return self._tokens.shape[-1]

    def items(self, work) -> np.ndarray:
        """work [(seq_id, start, count)] as the pp_step_item rows the native builder reads."""
        items = self._items[:len(work)]
        items[:] = work
        return items

    def arrays(self, n_tokens: int, n_items: int, n_logits: int):
        """Views of the built batch: (token_ids, positions, slot_mapping, seq_index, block_tables, logit_rows)."""
        tok, pos, slots, seqs = (row[:n_tokens] for row in self._tokens)
        tables = self._tables[:n_items * self.max_blocks_per_seq].reshape(n_items, self.max_blocks_per_seq)
        return tok, pos, slots, seqs, tables, self._rows[:n_logits]
