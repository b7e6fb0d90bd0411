"""Preemption: taking a running request's KV pages back when the pool runs
out. By recompute, its pages are dropped and it prefills again later (on a
CPU as cheap as copying); by swap, each sequence's pages are copied to host
memory and written back into fresh pages when it resumes. The scheduler
decides whom to preempt and when to resume; this module does the moving."""

from __future__ import annotations

from .kv_manager import SeqState
from .model_runner import ModelRunner
from .request import Sequence

PREEMPTION_MODES = ("recompute", "swap")


def release(runner: ModelRunner, seq: Sequence) -> None:
    """Give a sequence's pages (and any host copy) back."""
    if seq.kv is not None:
        runner.free(seq.kv)
        seq.kv = None
    seq.swapped_blocks = None


def swap_out(runner: ModelRunner, seq: Sequence) -> None:
    """Copy a sequence's pages (every layer group's, those it still holds) to host
    memory, then free them."""
    kv = runner.kv
    seq.swapped_blocks = {(g, i): runner.read_block(int(b))
                          for g in range(kv.n_groups)
                          for i, b in enumerate(kv.block_table(seq.kv.handle, g)) if b >= 0}
    seq.swapped_num_computed = seq.kv.num_computed
    seq.swapped_tokens = seq.token_ids[:seq.kv.num_tokens]
    runner.free(seq.kv)
    seq.kv = None


def swap_in(runner: ModelRunner, seq: Sequence) -> None:
    """Place a swapped-out sequence again and write its pages back (the caller
    has checked that the pool holds them). Pages a window group had given back
    are not restored: marking the tokens computed gives them back again."""
    kv = runner.kv
    handle, cached = kv.create(seq.swapped_tokens)
    for g in range(kv.n_groups):
        for i, block in enumerate(kv.block_table(handle, g)):
            data = seq.swapped_blocks.get((g, i))
            # cached prefix blocks already hold this data
            if block >= 0 and i * kv.block_size >= cached and data is not None:
                runner.write_block(int(block), data)
    kv.mark_computed(handle, seq.swapped_num_computed)
    seq.kv = SeqState(handle, seq.swapped_num_computed, len(seq.swapped_tokens))
    seq.swapped_blocks = None
