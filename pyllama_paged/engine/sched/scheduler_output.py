"""What the scheduler decided for one step, as plain data (ids and counts, no
sequence objects, no KV bytes): the token chunks each sequence computes, in
batch order, and the KV data that must move first, as block ids (and, for a
prefix restored from a tier, the tier's key). The engine carries the moves out
(KVMover), runs the runner over `items`, and hands the output back to
`Scheduler.update_from_output`, which advances progress."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SwapMove:
    """One page of a swapped sequence: its host copy is keyed by (seq_id, group, index)."""

    seq_id: int
    group: int           # layer group of the block table
    index: int           # logical block index in that group's table
    block_id: int        # the physical block: read from (swap-out) or written to (swap-in)


@dataclass(slots=True)
class TierLoad:
    """One page of a prefix restored from a lower tier: layer group `group`'s part of the
    tier entry `key` (pinned in the tiers until the engine has written it), into block_id."""

    block_id: int
    key: bytes
    group: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step, decided: chunks in batch order (decodes first), then the KV moves.

    `seq_ids[i]` computes `items[i] = (kv handle, first token, token count)`; the
    first `num_decodes` chunks are decodes. The engine makes the moves in one
    safe order: read every swapped-out page (its block may be handed to another
    sequence in this same step), write swapped-in pages, then pages restored from a
    prefix tier (placed after every swap-in, in order: a window group's page given
    back by one restore may be taken by the next, whose write must win), then
    copy-on-write."""

    seq_ids: list[int] = field(default_factory=list)
    items: list[tuple[int, int, int]] = field(default_factory=list)
    num_decodes: int = 0
    swap_out: list[SwapMove] = field(default_factory=list)
    swap_in: list[SwapMove] = field(default_factory=list)
    resumed_seq_ids: list[int] = field(default_factory=list)            # swapped in: host copies no longer needed
    tier_loads: list[TierLoad] = field(default_factory=list)            # after swap_in, in placement order
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write (src, dst)
    failed_request_ids: list[str] = field(default_factory=list)         # ended by the scheduler, with an error

    def add_chunk(self, seq_id: int, handle: int, start: int, num_tokens: int) -> None:
        self.seq_ids.append(seq_id)
        self.items.append((handle, start, num_tokens))

    @property
    def num_tokens(self) -> list[int]:
        """Tokens each chunk computes, in batch order."""
        return [n for _, _, n in self.items]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.items[self.num_decodes:])

    def items_array(self) -> np.ndarray:
        """items as the int32 [n, 3] array the runner and the pool read."""
        return np.array(self.items, dtype=np.int32).reshape(-1, 3)
