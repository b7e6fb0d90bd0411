"""The KV manager: where each sequence's KV rows live, paged (the block pool:
block tables, copy-on-write, prefix cache) or one contiguous slab of n_ctx
tokens per sequence (the paged=False baseline). Both answer the same
questions the model runner asks: slots and block tables, and a step's
batch built from them. Each keeps the token ids it placed (the native pool
for pages; the slab manager for slabs): the batch reads them there.""" 

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..._native import check, ffi, lib
from ...errors import OutOfBlocksError, PagedError
from .block_pool import BlockPool
from .events import PrefixCacheEvents
from .groups import KVGroups, window_blocks_held
from .step_batch import StepBuffers


@dataclass
class SeqState:
    """One sequence's KV as the runner sees it: its handle in the KV manager, how
    many tokens are placed there and how many of those have their KV computed.
    The token ids themselves live in the KV manager (and the engine's Sequence)."""

    handle: int
    num_computed: int = 0                 # tokens whose KV is in the cache
    num_tokens: int = 0                   # tokens placed (computed or not)


def place_tokens(kv, seq: SeqState, token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Place new tokens of seq in kv (pages taken, copy-on-write decided); returns the
    block copies (src, dst) that must be made before the next step writes KV."""
    if seq.num_tokens + len(token_ids) > kv.max_seq_len:
        raise PagedError(f"sequence would exceed the context of {kv.max_seq_len} tokens")
    copies = kv.append(seq.handle, token_ids)
    seq.num_tokens += len(token_ids)
    return copies


def place_decodes(kv, seqs: Sequence[SeqState], token_ids: Sequence[int]) -> list[tuple[int, int]] | None:
    """A decode step's placements, one token per sequence, in one native call: the block
    copies to make, or None (nothing placed) when that cannot be done at once (the pool may
    be short, a sequence would reach its context's end, or kv holds slabs): then place them
    one by one with place_tokens, which says why."""
    if not kv.paged or any(s.num_tokens + 1 > kv.max_seq_len for s in seqs):
        return None
    copies = kv.pool.append_each(np.fromiter((s.handle for s in seqs), np.int32, len(seqs)),
                                 np.asarray(token_ids, dtype=np.int32))
    if copies is not None:
        for s in seqs:
            s.num_tokens += 1
    return copies


def fork_state(kv, seq: SeqState) -> SeqState:
    """A new sequence in kv sharing every page of seq (copy-on-write on its last block) and
    its LoRA adapter."""
    return SeqState(kv.fork(seq.handle), seq.num_computed, seq.num_tokens)


def commit_chunks(kv, work: Sequence[tuple[SeqState, int]], items: np.ndarray | None = None,
                  item_pointer=None) -> None:
    """Mark a step's chunks [(seq, n)] computed, in the sequences and in the pool: for
    callers driving a ModelRunner without a scheduler (tests, benchmarks, direct use).
    items: the step's [(handle, first token, count)] rows when the caller built them (and
    item_pointer, them as const pp_step_item *)."""
    if items is None:
        items = np.array([(seq.handle, seq.num_computed, n) for seq, n in work], dtype=np.int32).reshape(-1, 3)
    for seq, n in work:
        seq.num_computed += n
    kv.commit_batch(items, item_pointer)


def new_cached_sequence(kv, token_ids: Sequence[int], lora=None) -> SeqState:
    """A new sequence in kv holding only the cached prefix of token_ids, computed (the
    rest is placed chunk by chunk with place_tokens). Slabs are reserved whole and
    hold every token, none computed. lora: the (adapter, scale) computing its KV, or None."""
    if len(token_ids) > kv.max_seq_len:
        raise PagedError(f"prompt of {len(token_ids)} tokens exceeds the context of {kv.max_seq_len}")
    handle, cached = kv.create_cached(token_ids, lora)
    return SeqState(handle, cached if kv.paged else 0, cached)


class SeqLoras:
    """Which LoRA adapter computes each sequence's KV: handle -> (adapter, scale), for the
    sequences that run one (the step reads it; forks inherit it)."""

    def __init__(self):
        self.of: dict[int, tuple] = {}

    @staticmethod
    def root(lora) -> int:
        """The prefix-cache chain's root for KV computed under lora ((adapter, scale) or None)."""
        return 0 if lora is None else lora[0].kv_root(lora[1])

    def remember(self, created: tuple[int, int], lora) -> tuple[int, int]:
        """Note a new sequence's adapter; created ((handle, cached)) passes through."""
        if lora is not None:
            self.of[created[0]] = lora
        return created

    def copy(self, parent: int, child: int) -> int:
        """A fork runs its parent's adapter; returns the child's handle."""
        if parent in self.of:
            self.of[child] = self.of[parent]
        return child

    def forget(self, handle: int) -> None:
        """A freed sequence's entry goes."""
        self.of.pop(handle, None)


class PagedKV:
    """KV placement through the block pool: pages, sharing, prefix cache."""

    paged = True

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int, groups: KVGroups | None = None):
        groups = groups or KVGroups.single(1)
        self.groups = groups
        self.pool = BlockPool(num_blocks, block_size, groups.group_window)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.n_groups = groups.n_groups
        self.max_seq_len = max_seq_len
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.events = None   # a PrefixCacheEvents told of what becomes computed (watch_cache)
        self.loras = SeqLoras()

    def watch_cache(self, listener) -> None:
        """Report the prefix cache's changes to listener (a KVEventListener; None: stop). The
        first report clears whatever a consumer knew of an earlier pool (a restarted server)."""
        self.events = None if listener is None else PrefixCacheEvents(self, listener)
        if self.events is not None:
            self.events.cleared()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        self.pool.reset_prefix_cache()
        if self.events is not None:
            self.events.cleared()

    def create(self, token_ids: Sequence[int], lora=None) -> tuple[int, int]:
        """A sequence holding token_ids; returns (handle, tokens already cached). lora: the
        (adapter, scale) its KV is computed under (None: the base model): prefix-cache hits
        come only from sequences computed under the same."""
        return self.loras.remember(self.pool.create_sequence(token_ids, self.loras.root(lora)), lora)

    def create_cached(self, token_ids: Sequence[int], lora=None) -> tuple[int, int]:
        """A sequence holding only the cached prefix of token_ids: (handle, its length)."""
        return self.loras.remember(self.pool.create_cached(token_ids, self.loras.root(lora)), lora)

    def create_uncached(self, token_ids: Sequence[int], lora=None) -> int:
        """A sequence holding token_ids, every block new (no prefix-cache lookup)."""
        return self.loras.remember((self.pool.create_uncached(token_ids, self.loras.root(lora)), 0), lora)[0]

    def append(self, handle: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        return self.pool.append(handle, token_ids)

    def fork(self, handle: int) -> int:
        return self.loras.copy(handle, self.pool.fork(handle))

    def free(self, handle: int) -> None:
        self.pool.free(handle)
        self.loras.forget(handle)

    def mark_computed(self, handle: int, num_tokens: int) -> None:
        self.pool.mark_computed(handle, num_tokens)
        if self.events is not None:
            self.events.marked(handle, num_tokens)

    def can_create(self, num_tokens: int, reserve: int = 0) -> bool:
        """Whether a new sequence of num_tokens fits, keeping `reserve` blocks free."""
        return -(-num_tokens // self.block_size) * self.n_groups + reserve <= self.pool.num_allocatable

    def blocks_to_prefill(self, num_tokens: int, chunk: int) -> int:
        """Blocks a sequence of num_tokens holds at most while prefilled chunk tokens at a
        time: all of them in full-attention groups, a window plus a chunk in window groups."""
        blocks = -(-num_tokens // self.block_size)
        need = 0
        for w in self.groups.group_window:
            need += blocks if w <= 0 else min(blocks, window_blocks_held(w, self.block_size, chunk))
        return need

    def blocks_needed(self, handle: int, num_tokens: int) -> int:
        """Blocks appending num_tokens to a sequence takes (copy-on-write included)."""
        return self.pool.blocks_needed(handle, num_tokens)

    def can_append_all(self, appends: Sequence[tuple[int, int]]) -> bool:
        """Whether every (handle, num_tokens) append fits at once (copy-on-write included)."""
        need = sum(self.pool.blocks_needed(handle, n) for handle, n in appends)
        return need <= self.pool.num_allocatable

    @property
    def num_allocatable(self) -> int:
        """Blocks an allocation could take now."""
        return self.pool.num_allocatable

    def capacity_tokens(self) -> int:
        """The most tokens one sequence could ever hold here: its full-attention groups
        grow with it, each window group holds at most its window plus a block."""
        full = sum(1 for w in self.groups.group_window if w <= 0)
        # a decode places one token at a time: at most a block beyond the window's
        window_blocks = sum(window_blocks_held(w, self.block_size, self.block_size)
                            for w in self.groups.group_window if w > 0)
        if full == 0:
            blocks = self.max_blocks_per_seq if window_blocks <= self.num_blocks else 0
        else:
            blocks = max(0, self.num_blocks - window_blocks) // full
        # a short sequence holds all groups' blocks for every token
        blocks = max(blocks, self.num_blocks // self.n_groups)
        return min(blocks, self.max_blocks_per_seq) * self.block_size

    def slot_mapping(self, handle: int, start: int, count: int) -> np.ndarray:
        return self.pool.slot_mapping(handle, start, count)

    def block_table(self, handle: int, group: int = 0) -> np.ndarray:
        return self.pool.block_table(handle, group)

    def batch_arrays(self, handle: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(slot_mapping [n_groups * count], block_tables [n_groups, 1, max_blocks]) of one
        sequence's tokens [start, start + count), for ModelRunner.forward."""
        items = np.array([[handle, start, count]], dtype=np.int32)
        buffers = StepBuffers()
        buffers.reserve(count, 1, self.max_blocks_per_seq, self.n_groups)
        n, _ = self.build_batch(items, buffers)
        _, _, slots, _, tables, _ = buffers.arrays(n, 1, 0)
        return slots.copy(), tables.copy()

    def build_batch(self, items: np.ndarray, buffers: StepBuffers) -> tuple[int, int]:
        """A step's batch for items [(handle, start, count)] into buffers, in one native
        call; returns (tokens, logit rows)."""
        b = buffers.native
        check(lib.pp_pool_build_batch(self.pool._live, buffers.item_pointer(items),
                                      len(items), buffers.max_blocks_per_seq, buffers.capacity_tokens, b),
              "build_batch")
        buffers.n_tokens = b.n_tokens
        return b.n_tokens, b.n_logits

    def commit_batch(self, items: np.ndarray, item_pointer=None) -> None:
        """Mark what a step computed (its full blocks become prefix-cache hits); item_pointer:
        items as const pp_step_item * when the caller holds it (StepBuffers.item_pointer)."""
        if item_pointer is None:
            item_pointer = ffi.cast("const pp_step_item *", ffi.from_buffer(items))
        check(lib.pp_pool_commit_batch(self.pool._live, item_pointer, len(items)), "commit_batch")
        if self.events is not None:
            self.events.computed(items)

    def close(self) -> None:
        if self.events is not None:   # the cache goes with the pool
            self.events.cleared()
            self.events.flush()
            self.events = None
        self.pool.close()


class SlabKV:
    """One max_seq_len slab per sequence, reserved whole (the naive allocator)."""

    paged = False
    n_groups = 1
    events = None   # no prefix cache to report on

    def __init__(self, num_slabs: int, max_seq_len: int):
        self.block_size = max_seq_len
        self.max_seq_len = max_seq_len
        self.num_blocks = num_slabs
        self.max_blocks_per_seq = 1
        self._free = list(range(num_slabs - 1, -1, -1))
        self._tokens: dict[int, list[int]] = {}   # handle (= slab id) -> the tokens it holds
        self.loras = SeqLoras()

    def create(self, token_ids: Sequence[int], lora=None) -> tuple[int, int]:
        if len(token_ids) > self.block_size:
            raise PagedError(f"sequence of {len(token_ids)} tokens exceeds n_ctx {self.block_size}")
        if not self._free:
            raise OutOfBlocksError(f"out of KV slabs: all {self.num_blocks} are in use")
        slab = self._free.pop()
        self._tokens[slab] = list(token_ids)
        return self.loras.remember((slab, 0), lora)

    def create_cached(self, token_ids: Sequence[int], lora=None) -> tuple[int, int]:
        """A slab holding all of token_ids (slabs are reserved whole; nothing is cached)."""
        handle, _ = self.create(token_ids, lora)
        return handle, len(token_ids)

    def create_uncached(self, token_ids: Sequence[int], lora=None) -> int:
        return self.create(token_ids, lora)[0]

    def blocks_to_prefill(self, num_tokens: int, chunk: int) -> int:
        return 1

    def blocks_needed(self, handle: int, num_tokens: int) -> int:
        return 0 if self.can_append(handle, num_tokens) else self.num_blocks + 1

    def append(self, handle: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        n = len(self._tokens[handle]) + len(token_ids)
        if n > self.block_size:
            raise OutOfBlocksError(f"sequence would grow to {n} tokens, past its slab of {self.block_size}")
        self._tokens[handle].extend(token_ids)
        return []

    def fork(self, handle: int) -> int:
        raise PagedError("paged=False cannot share a sequence's KV (no fork)")

    def free(self, handle: int) -> None:
        del self._tokens[handle]
        self._free.append(handle)
        self.loras.forget(handle)

    def mark_computed(self, handle: int, num_tokens: int) -> None:
        pass  # slabs are never shared

    def can_create(self, num_tokens: int, reserve: int = 0) -> bool:
        return num_tokens <= self.block_size and len(self._free) > 0

    def can_append(self, handle: int, num_tokens: int) -> bool:
        return len(self._tokens[handle]) + num_tokens <= self.block_size

    def can_append_all(self, appends: Sequence[tuple[int, int]]) -> bool:
        return all(self.can_append(handle, n) for handle, n in appends)

    def capacity_tokens(self) -> int:
        return self.block_size

    @property
    def num_allocatable(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def slot_mapping(self, handle: int, start: int, count: int) -> np.ndarray:
        return np.arange(start, start + count, dtype=np.int32) + handle * self.block_size

    def block_table(self, handle: int, group: int = 0) -> np.ndarray:
        return np.array([handle], dtype=np.int32)

    def batch_arrays(self, handle: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self.slot_mapping(handle, start, count), np.array([[[handle]]], dtype=np.int32)

    def build_batch(self, items: np.ndarray, buffers: StepBuffers) -> tuple[int, int]:
        """PagedKV.build_batch for slabs (in Python: this is the baseline)."""
        n = sum(int(count) for _, _, count in items)
        buffers.n_tokens = n
        tok, pos, slots, seqs, tables, rows = buffers.arrays(n, len(items), len(items))
        tables = tables[0]
        at, n_logits = 0, 0
        for i, (handle, start, count) in enumerate(items.tolist()):
            held = self._tokens.get(handle)
            if held is None or count < 1 or start < 0 or start + count > len(held):
                raise PagedError(f"step item {i}: tokens [{start}, {start + count}) outside slab {handle}")
            tok[at:at + count] = held[start:start + count]
            pos[at:at + count] = np.arange(start, start + count)
            slots[at:at + count] = pos[at:at + count] + handle * self.block_size
            seqs[at:at + count] = i
            tables[i, 0] = handle
            at += count
            if start + count == len(held):
                rows[n_logits] = at - 1
                n_logits += 1
        return at, n_logits

    def commit_batch(self, items: np.ndarray, item_pointer=None) -> None:
        pass  # slabs are never shared

    def close(self) -> None:
        self._free.clear()
