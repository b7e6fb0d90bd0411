"""The KV data a step moves, on the engine's side. The scheduler decides in ids and
counts (SchedulerOutput) and keeps the books; KVMover moves the bytes through the
model runner: before the model runs, swapped-out pages to host, swapped-in pages
back, prefix pages restored from the tiers, copy-on-write copies (in that order:
SchedulerOutput says why); after it ran, the blocks the step filled down to the
tiers, before the scheduler's commit may give a sliding-window group's blocks back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sched.scheduler_output import SchedulerOutput, SwapMove, TierLoad
from .kv.prefix_tiers import PrefixTiers


class SwapSpace:
    """The host copies of swapped-out pages, keyed by (seq_id, group, index): made and
    written back by KVMover as the scheduler's SwapMoves ask."""

    def __init__(self):
        self._pages: dict[int, dict[tuple[int, int], np.ndarray]] = {}

    def save(self, move: SwapMove, data: np.ndarray) -> None:
        self._pages.setdefault(move.seq_id, {})[(move.group, move.index)] = data

    def take(self, move: SwapMove) -> np.ndarray:
        """The host copy of a page being swapped back in (dropped from the space)."""
        pages = self._pages[move.seq_id]
        data = pages.pop((move.group, move.index))
        if not pages:
            del self._pages[move.seq_id]
        return data

    def drop(self, seq_id: int) -> None:
        """Forget a sequence's copies (its request ended while swapped, or it came back
        with some pages from the prefix cache instead)."""
        self._pages.pop(seq_id, None)

    @property
    def num_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())


@dataclass(slots=True)
class _Chain:
    """A sequence's tier keys as far as computed, under the pool handle its tokens were read
    from, and the first of its blocks not yet written down."""

    handle: int
    next_block: int
    keys: list[bytes] = field(default_factory=list)


class KVMover:
    """Carries out the KV data moves of one engine's steps through its model runner."""

    def __init__(self, runner):
        self.runner = runner
        self.swap_space = SwapSpace()
        self.tiers: PrefixTiers | None = None   # the prefix cache below the pool, if any
        self._chains: dict[int, _Chain] = {}    # seq id -> chain, for the last step's sequences

    # ---- before the model runs ---------------------------------------------------
    def apply(self, output: SchedulerOutput) -> None:
        """A step's moves before the model runs, in the one safe order (SchedulerOutput says
        why): swapped-out pages to host, swapped-in pages back, prefix pages from the tiers,
        copy-on-write copies."""
        self.swap_out(output.swap_out)
        self.swap_in(output.swap_in, output.resumed_seq_ids)
        self.load_from_tiers(output.tier_loads)
        self.copy_on_write(output.block_copies)

    def swap_out(self, moves: list[SwapMove]) -> None:
        """Copy swapped-out pages to host: first, since their blocks may be handed to other
        sequences in this same step."""
        for move in moves:
            self.swap_space.save(move, self.runner.read_block(move.block_id))

    def swap_in(self, moves: list[SwapMove], resumed_seq_ids: list[int]) -> None:
        """Write swapped-in pages back; the resumed sequences' other copies are dropped
        (pages the prefix cache still held came back without a write)."""
        for move in moves:
            self.runner.write_block(move.block_id, self.swap_space.take(move))
        for seq_id in resumed_seq_ids:
            self.swap_space.drop(seq_id)

    def load_from_tiers(self, loads: list[TierLoad]) -> None:
        """Write the prefix pages restored from the tiers (pinned there by schedule()), in
        placement order: a window group's page given back by one restore may be taken by
        the next, whose write must win."""
        if self.tiers is None:
            return
        try:
            for load in loads:
                self.runner.write_block(load.block_id, self.tiers.pinned(load.key, load.group))
        finally:
            self.tiers.unpin_all()

    def copy_on_write(self, copies: list[tuple[int, int]]) -> None:
        """Copy shared blocks into the private ones (src, dst) a step writes instead."""
        self.runner.copy_blocks(copies)

    # ---- after it ran ----------------------------------------------------------------
    def save_to_tiers(self, output: SchedulerOutput) -> None:
        """Write the blocks the step filled into the tiers, before the scheduler commits it:
        afterwards a sliding-window group may have given them back. A sequence's blocks
        filled outside the step's items since its last one (accepted draft tokens,
        committed after sampling) go down with them."""
        if self.tiers is None:
            return
        bs = self.runner.kv.block_size
        chains = {}
        adapted = self.runner.kv.loras.of   # the tiers' chains hold base-model KV only
        for seq_id, (handle, start, count) in zip(output.seq_ids, output.items):
            if handle in adapted:
                continue
            chain = self._chains.get(seq_id)
            if chain is None or chain.handle != handle:   # new, or placed again since
                chain = _Chain(handle, start // bs)
            end = (start + count) // bs
            first = min(chain.next_block, start // bs)
            if first < end:
                self._save(chain, first, end)
            chain.next_block = max(first, end)
            chains[seq_id] = chain
        self._chains = chains

    def _save(self, chain: _Chain, first: int, end: int) -> None:
        kv, tiers = self.runner.kv, self.tiers
        if len(chain.keys) < end:
            chain.keys = tiers.keys(kv.pool.tokens(chain.handle), end, chain.keys)
        tables = None
        for i in range(first, end):
            key = chain.keys[i]
            if tiers.has(key):
                continue
            if tables is None:
                tables = [kv.block_table(chain.handle, g) for g in range(kv.n_groups)]
            blocks = [int(t[i]) if i < len(t) else -1 for t in tables]
            if min(blocks) < 0:
                continue   # a group holds no page for it: not a complete entry
            tiers.save(key, np.concatenate([self.runner.read_block(b) for b in blocks]))

    def forget(self, seq_id: int) -> None:
        """An ended request's sequence: drop its host copies."""
        self.swap_space.drop(seq_id)
