"""Preemption: taking a running request's KV pages back when the pool runs
out. By recompute, its pages are dropped and it prefills again later (on a
CPU as cheap as copying); by swap, each sequence's pages are copied to host
memory and written back into fresh pages when it resumes. The scheduler
decides whom to preempt and when to resume; this module does the page
bookkeeping and says which blocks' data must move: the engine moves it
(StepPlan.carry_out) before the step that follows writes anything."""

from __future__ import annotations

import numpy as np

from .kv_manager import SeqState
from .request import Sequence

PREEMPTION_MODES = ("recompute", "swap")


def release(kv, seq: Sequence) -> None:
    """Give a sequence's pages (and any host copy) back."""
    if seq.kv is not None:
        kv.free(seq.kv.handle)
        seq.kv = None
    seq.swapped_blocks = None


def swap_out(kv, seq: Sequence) -> dict[tuple[int, int], int]:
    """Free a sequence's pages for a swap; returns the blocks whose data is its KV,
    {(layer group, table index): block}, to copy to host before any is reused
    (only the pages each group still holds: a window group's released ones are gone)."""
    blocks = {(g, i): int(b) for g in range(kv.n_groups)
              for i, b in enumerate(kv.block_table(seq.kv.handle, g)) if b >= 0}
    seq.swapped_num_computed = seq.kv.num_computed
    seq.swapped_tokens = seq.token_ids[:seq.kv.num_tokens]
    kv.free(seq.kv.handle)
    seq.kv = None
    return blocks


def swap_in(kv, seq: Sequence) -> list[tuple[int, np.ndarray]]:
    """Place a swapped-out sequence again (the caller has checked that the pool holds
    it); returns the (block, host copy) writes that restore its KV. Pages a window
    group had given back are not restored: marking the tokens computed gives them
    back again; blocks the prefix cache already holds need no write."""
    handle, cached = kv.create(seq.swapped_tokens)
    writes = []
    for g in range(kv.n_groups):
        for i, block in enumerate(kv.block_table(handle, g)):
            data = seq.swapped_blocks.get((g, i))
            if block >= 0 and i * kv.block_size >= cached and data is not None:
                writes.append((int(block), data))
    kv.mark_computed(handle, seq.swapped_num_computed)
    seq.kv = SeqState(handle, seq.swapped_num_computed, len(seq.swapped_tokens))
    seq.swapped_blocks = None
    return writes
