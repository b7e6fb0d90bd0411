"""KV-cache events: which full blocks the prefix cache holds, told to a listener as
they are stored, evicted or cleared, so that a router in front of several servers
can send a prompt where its prefix is already cached.

The native pool has no callbacks; it changes only inside calls the engine thread
makes, so the watcher here reads what those calls did: a commit makes blocks full
and computed (stored), and an eviction takes a cached block for new data (removed;
the pool counts evictions, so the watcher looks only when that count moved). The
watcher knows nothing of how events travel: it hands each step's list to a
KVEventListener (the server's ZMQ publisher is one), which must not block."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from ..._native import ffi, lib

# A full look over the stored blocks at least this often, even without evictions: it
# catches the rare hash whose only registered block went away without an eviction
# (a duplicate block of the same tokens that was computed first, then freed).
RESCAN_SECONDS = 2.0


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the prefix cache."""
    block_hashes: list[int]
    parent_block_hash: int | None   # the block before the first one (None: they start the sequence)
    token_ids: list[int]            # every token of those blocks, in order
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These blocks left the prefix cache (evicted for new data)."""
    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset, or the engine closed)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventListener(Protocol):
    def kv_events(self, events: list[KVEvent]) -> None:
        """One engine step's events, in order; called on the engine thread, so it must not block."""


def reference_group(group_window: Sequence[int]) -> int:
    """The layer group whose blocks stand for the cache: the first full-attention one (a
    prefix hit needs all of its blocks), else the first."""
    return next((g for g, w in enumerate(group_window) if w <= 0), 0)


class PrefixCacheEvents:
    """Watches one paged KV manager's prefix cache and reports its changes to a listener.
    Only the reference group's blocks are reported: every group holds the same chain of
    hashes, so one group's blocks say which prefixes are cached."""

    def __init__(self, kv, listener: KVEventListener):
        self.kv = kv
        self.pool = kv.pool
        self.listener = listener
        self.block_size = kv.block_size
        self.group = reference_group(kv.groups.group_window)
        self.live: dict[int, set[int]] = {}   # hash -> blocks of the reference group holding it
        self.pending: list[KVEvent] = []
        self._evictions = self.pool.stats().num_evictions
        self._scanned_at = time.monotonic()
        self._info = ffi.new("pp_block_info *")   # reused by every block read (no allocation per block)

    # ---- what the KV manager reports -------------------------------------------
    def computed(self, items: np.ndarray) -> None:
        """A step's items [(handle, start, count)] are computed: report the blocks they filled."""
        bs = self.block_size
        for handle, start, count in items.tolist():
            first, end = start // bs, (start + count) // bs
            if first < end:
                self._stored(handle, first, end)

    def marked(self, handle: int, num_tokens: int) -> None:
        """A sequence's first num_tokens tokens were marked computed at once (swapped back in)."""
        if num_tokens >= self.block_size:
            self._stored(handle, 0, num_tokens // self.block_size)

    def cleared(self) -> None:
        """The prefix cache was dropped whole."""
        self.live.clear()
        self.pending.append(AllBlocksCleared())

    def flush(self) -> None:
        """End of a step: find evicted blocks, then hand the step's events over (if any)."""
        evictions = self.pool.stats().num_evictions
        now = time.monotonic()
        if self.live and (evictions != self._evictions or now - self._scanned_at >= RESCAN_SECONDS):
            self._removed()
            self._scanned_at = now
        self._evictions = evictions
        if self.pending:
            events, self.pending = self.pending, []
            self.listener.kv_events(events)

    # ---- reading the pool --------------------------------------------------------
    def _read(self, block: int) -> int | None:
        """The hash a reference-group block holds as a computed cache entry, or None."""
        info = self._info
        if lib.pp_pool_block_info(self.pool._live, block, info) != lib.PP_OK:
            return None
        if not (info.has_hash and info.is_computed and info.group == self.group
                and info.state != lib.PP_BLOCK_FREE):
            return None
        return int(info.hash)

    def _stored(self, handle: int, first: int, end: int) -> None:
        """Blocks [first, end) of a sequence are full and computed: one BlockStored for each
        run of them whose hashes the cache did not hold yet."""
        table = self.pool.block_table(handle, self.group)
        run: list[int] = []   # hashes of the current run of new blocks
        run_start = first
        parent = None

        def close_run():
            if run:
                tokens = self.pool.tokens(handle)[run_start * self.block_size:(run_start + len(run)) * self.block_size]
                self.pending.append(BlockStored(list(run), parent, tokens.tolist(), self.block_size))

        if first > 0 and table[first - 1] >= 0:
            parent = self._read(int(table[first - 1]))
        for i in range(first, min(end, len(table))):
            block = int(table[i])
            h = self._read(block) if block >= 0 else None
            if h is None or h in self.live:
                if h is not None:
                    self.live[h].add(block)   # a second block of cached tokens (kept to know when both go)
                close_run()
                run, run_start = [], i + 1
            else:
                self.live[h] = {block}
                run.append(h)
            if not run:
                parent = h
        close_run()

    def _removed(self) -> None:
        """Every stored hash none of whose blocks still holds it: one BlockRemoved."""
        gone = []
        for h, blocks in list(self.live.items()):
            blocks = {b for b in blocks if self._read(b) == h}
            if blocks:
                self.live[h] = blocks
            else:
                del self.live[h]
                gone.append(h)
        if gone:
            # first in the batch: the evictions happened while the step was scheduled, before
            # its commit stored blocks
            self.pending.insert(0, BlockRemoved(gone))
