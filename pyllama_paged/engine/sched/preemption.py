"""Preemption: taking a running request's KV pages back when the pool runs
out. By recompute, its pages are dropped and it prefills again later (on a
CPU as cheap as copying); by swap, each sequence's pages are copied to host
memory and written back into fresh pages when it resumes. The scheduler
decides whom to preempt and when to resume; this module does the page
bookkeeping and says which blocks' data must move (SwapMove ids): the engine
moves it, and keeps the host copies (kv_moves.SwapSpace), before the step
that follows writes anything."""

from __future__ import annotations

from ..kv.manager import SeqState
from .request import Sequence
from .scheduler_output import SwapMove

PREEMPTION_MODES = ("recompute", "swap")


def release(kv, seq: Sequence) -> None:
    """Give a sequence's pages back (and forget which pages it had swapped out)."""
    if seq.kv is not None:
        kv.free(seq.kv.handle)
        seq.kv = None
    seq.swapped_pages = None


def swap_out(kv, seq: Sequence) -> list[SwapMove]:
    """Free a sequence's pages for a swap; returns the blocks whose data is its KV, to
    copy to host before any is reused (only the pages each group still holds: a
    window group's released ones are gone)."""
    moves = [SwapMove(seq.seq_id, g, i, int(b)) for g in range(kv.n_groups)
             for i, b in enumerate(kv.block_table(seq.kv.handle, g)) if b >= 0]
    seq.swapped_pages = {(m.group, m.index) for m in moves}
    seq.swapped_num_computed = seq.kv.num_computed
    seq.swapped_tokens = seq.token_ids[:seq.kv.num_tokens]
    kv.free(seq.kv.handle)
    seq.kv = None
    return moves


def swap_in(kv, seq: Sequence, lora=None) -> list[SwapMove]:
    """Place a swapped-out sequence again (the caller has checked that the pool holds
    it); returns the pages whose host copies restore its KV. Pages a window group had
    given back are not restored: marking the tokens computed gives them back again;
    blocks the prefix cache already holds need no write."""
    handle, cached = kv.create(seq.swapped_tokens, lora)
    moves = []
    for g in range(kv.n_groups):
        for i, block in enumerate(kv.block_table(handle, g)):
            if block >= 0 and i * kv.block_size >= cached and (g, i) in seq.swapped_pages:
                moves.append(SwapMove(seq.seq_id, g, i, int(block)))
    kv.mark_computed(handle, seq.swapped_num_computed)
    seq.kv = SeqState(handle, seq.swapped_num_computed, len(seq.swapped_tokens))
    seq.swapped_pages = None
    return moves

