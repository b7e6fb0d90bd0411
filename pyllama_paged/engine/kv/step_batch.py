"""A step's flat batch, the arrays the native forward step takes (tokens,
positions, sequence index, logit rows, and per layer group the slot mapping
and block tables), held in buffers reused from step to step and grown only
when a step needs more."""

from __future__ import annotations

import numpy as np

from ..._native import ffi


def _ptr(arr: np.ndarray, ctype: str = "int32_t *"):
    return ffi.cast(ctype, ffi.from_buffer(arr))


class StepBuffers:
    """Reused int32 buffers for one step's batch; `native` is the pp_step_buffers over them."""

    def __init__(self):
        self.native = ffi.new("pp_step_buffers *")
        self._tokens = np.empty((3, 0), dtype=np.int32)     # token_ids, positions, seq_index
        self._slots = np.empty(0, dtype=np.int32)           # n_groups runs of n_tokens
        self._tables = np.empty(0, dtype=np.int32)          # n_groups runs of n_items rows
        self._rows = np.empty(0, dtype=np.int32)
        self._items = np.empty((0, 3), dtype=np.int32)
        self.max_blocks_per_seq = 1
        self.n_groups = 1
        self.n_tokens = 0
        self.pointers = ()   # (token_ids, positions, slot_mapping, seq_index, block_tables, logit_rows)
        self._items_pointer = None
        self.last_items = self._items   # the rows items() last wrote

    def reserve(self, n_tokens: int, n_items: int, max_blocks_per_seq: int, n_groups: int = 1) -> None:
        """Room for a step of n_tokens tokens over n_items sequences and n_groups layer groups."""
        grown = not self.pointers
        if n_tokens > self._tokens.shape[-1]:
            self._tokens = np.empty((3, max(n_tokens, 2 * self._tokens.shape[-1])), dtype=np.int32)
            grown = True
        if n_tokens * n_groups > self._slots.size:
            self._slots = np.empty(max(self._tokens.shape[-1] * n_groups, 2 * self._slots.size), dtype=np.int32)
            grown = True
        if n_groups * n_items * max_blocks_per_seq > self._tables.size:
            self._tables = np.empty(max(n_groups * n_items * max_blocks_per_seq, 2 * self._tables.size),
                                    dtype=np.int32)
            grown = True
        if n_items > len(self._rows):
            self._rows = np.empty(max(n_items, 2 * len(self._rows)), dtype=np.int32)
            self._items = np.empty((len(self._rows), 3), dtype=np.int32)
            self._items_pointer = ffi.cast("const pp_step_item *", ffi.from_buffer(self._items))
            grown = True
        self.max_blocks_per_seq = max_blocks_per_seq
        self.n_groups = n_groups
        if grown:
            # cast once per allocation, not per step: a decode step's Python runs with caches
            # the weights just streamed through, where each cffi call costs microseconds
            tok, pos, seqs = (_ptr(row) for row in self._tokens)
            self.pointers = (tok, pos, _ptr(self._slots), seqs, _ptr(self._tables), _ptr(self._rows))
            b = self.native
            b.token_ids, b.positions, b.slot_mapping, b.seq_index, b.block_tables, b.logit_rows = self.pointers

    @property
    def capacity_tokens(self) -> int:
        return min(self._tokens.shape[-1], self._slots.size // self.n_groups)

    def items(self, work) -> np.ndarray:
        """work [(seq_id, start, count)] as the pp_step_item rows the native builder reads."""
        items = self._items[:len(work)]
        items[:] = work
        self.last_items = items
        return items

    def item_pointer(self, items: np.ndarray):
        """items (int32 [n, 3], contiguous) as const pp_step_item *: the cached cast when they
        are this buffer's own rows (items())."""
        if items.base is self._items and self._items_pointer is not None:
            return self._items_pointer
        return ffi.cast("const pp_step_item *", ffi.from_buffer(items))

    def arrays(self, n_tokens: int, n_items: int, n_logits: int):
        """Views of the built batch: (token_ids, positions, slot_mapping [n_groups * n_tokens],
        seq_index, block_tables [n_groups, n_items, max_blocks], logit_rows)."""
        tok, pos, seqs = (row[:n_tokens] for row in self._tokens)
        slots = self._slots[:self.n_groups * n_tokens]
        tables = self._tables[:self.n_groups * n_items * self.max_blocks_per_seq].reshape(
            self.n_groups, n_items, self.max_blocks_per_seq)
        return tok, pos, slots, seqs, tables, self._rows[:n_logits]
