"""BlockPool: Python face of the native block pool (block tables, ref counts,
copy-on-write, prefix cache). Holds no policy; the scheduler decides."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..._native import PP_ERR_OUT_OF_BLOCKS, NativeHandle, check, ffi, lib
from ...errors import PagedError


class BlockState(enum.IntEnum):
    """enum pp_block_state, its values read from the library."""
    FREE = lib.PP_BLOCK_FREE
    USED = lib.PP_BLOCK_USED
    CACHED = lib.PP_BLOCK_CACHED


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    block_size: int
    num_free: int
    num_used: int
    num_cached: int
    num_shared: int
    num_seqs: int
    num_hits: int
    num_misses: int
    num_evictions: int
    num_cow_copies: int
    tokens_stored: int
    tokens_logical: int
    slots_held: int
    n_groups: int = 1

    @property
    def utilization(self) -> float:
        """Tokens stored / token slots held by used blocks (1.0 when none held)."""
        return self.tokens_stored / self.slots_held if self.slots_held else 1.0

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits / full blocks looked up (0.0 before any lookup)."""
        looked_up = self.num_hits + self.num_misses
        return self.num_hits / looked_up if looked_up else 0.0


@dataclass(frozen=True)
class BlockInfo:
    state: BlockState
    ref_count: int
    num_tokens: int
    hash: int | None
    is_computed: bool
    group: int = 0


def _token_array(token_ids: Sequence[int]):
    """A C int32 buffer over token_ids (kept alive by the returned numpy array)."""
    arr = np.ascontiguousarray(token_ids, dtype=np.int32)
    return arr, ffi.cast("const int32_t *", ffi.from_buffer(arr))


class BlockPool(NativeHandle):
    """A pool of num_blocks KV blocks of block_size tokens and the sequences in it.
    group_window: one entry per layer group sharing the pool (0: the group keeps
    every token; w: it gives back blocks once past the last w tokens)."""

    _destroy = staticmethod(lib.pp_pool_destroy)

    def __init__(self, num_blocks: int, block_size: int, group_window: Sequence[int] = (0,)):
        out = ffi.new("pp_block_pool **")
        windows = ffi.new("int32_t[]", list(group_window))
        check(lib.pp_pool_create_grouped(num_blocks, block_size, len(group_window), windows, out), "BlockPool")
        self._handle = out[0]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_window = tuple(group_window)
        self.n_groups = len(group_window)
        self._i32 = ffi.new("int32_t *")
        self._one_token = ffi.new("int32_t[1]")
        self._i32b = ffi.new("int32_t *")
        self._copy = ffi.new("pp_block_copy[]", self.n_groups)
        self._each_copies = None   # append_each's, grown to the largest step

    # lifecycle: NativeHandle's close() frees the pool and every sequence in it ------------
    @property
    def _live(self):
        """The native pool; PagedError once it is closed."""
        if self._handle is None:
            raise PagedError("the block pool is closed")
        return self._handle

    # pool ------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A snapshot of the pool's counters."""
        out = ffi.new("pp_pool_stats *")
        check(lib.pp_pool_stats_get(self._live, out), "stats")
        return PoolStats(**{f: getattr(out, f) for f in PoolStats.__dataclass_fields__})

    def block_info(self, block_id: int) -> BlockInfo:
        """State, ref count, fill and hash of one physical block."""
        out = ffi.new("pp_block_info *")
        check(lib.pp_pool_block_info(self._live, block_id, out), "block_info")
        return BlockInfo(BlockState(out.state), out.ref_count, out.num_tokens,
                         out.hash if out.has_hash else None, bool(out.is_computed), out.group)

    @property
    def num_allocatable(self) -> int:
        """Blocks an allocation could take now: free plus evictable cached."""
        return lib.pp_pool_num_allocatable(self._live)

    def evict(self, max_blocks: int) -> int:
        """Evict up to max_blocks cached blocks (LRU first); returns how many."""
        check(lib.pp_pool_evict(self._live, max_blocks, self._i32), "evict")
        return self._i32[0]

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache entry."""
        check(lib.pp_pool_reset_prefix_cache(self._live), "reset_prefix_cache")

    def weaken_hash(self, bits: int) -> None:
        """Keep only `bits` bits of every block hash, to provoke collisions in tests
        (only while the pool is empty)."""
        check(lib.pp_pool_weaken_hash(self._live, bits), "weaken_hash")

    def hash_block(self, parent_hash: int, token_ids: Sequence[int]) -> int:
        """This pool's (keyed) chained hash of one full block of token ids."""
        arr, ptr = _token_array(token_ids)
        return lib.pp_hash_block(self._live, parent_hash, ptr, len(arr))

    def set_hash_key(self, k0: int, k1: int) -> None:
        """Replace the pool's random hash key (only while the pool is empty)."""
        check(lib.pp_pool_set_hash_key(self._live, k0, k1), "set_hash_key")

    # sequences -------------------------------------------------------------
    def create_sequence(self, token_ids: Sequence[int] = (), root: int = 0) -> tuple[int, int]:
        """New sequence holding token_ids; returns (seq_id, num_cached_tokens). root: the
        parent hash of its first block (0: the plain chain; a LoRA adapter's kv_root keeps
        its KV apart from every other adapter's)."""
        return self._create(lib.PP_SEQ_CREATE, token_ids, root, "create_sequence")

    def create_uncached(self, token_ids: Sequence[int], root: int = 0) -> int:
        """New sequence holding token_ids in new blocks, without prefix-cache lookup."""
        return self._create(lib.PP_SEQ_CREATE_UNCACHED, token_ids, root, "create_uncached")[0]

    def create_cached(self, token_ids: Sequence[int], root: int = 0) -> tuple[int, int]:
        """New sequence holding only the prefix of token_ids found in the cache (taking no
        new block); returns (seq_id, num_cached_tokens). Append the rest as it is computed."""
        return self._create(lib.PP_SEQ_CREATE_CACHED, token_ids, root, "create_cached")

    def _create(self, mode: int, token_ids: Sequence[int], root: int, what: str) -> tuple[int, int]:
        arr, ptr = _token_array(token_ids)
        check(lib.pp_seq_create_rooted(self._live, root, mode, ptr, len(arr), self._i32, self._i32b), what)
        return self._i32[0], self._i32b[0]

    def append(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens; returns the copy-on-write (src, dst) block copies to do."""
        if len(token_ids) == 1:   # a decode step's token: no array to make
            self._one_token[0] = token_ids[0]
            n, ptr = 1, self._one_token
        else:
            arr, ptr = _token_array(token_ids)
            n = len(arr)
        check(lib.pp_seq_append(self._live, seq_id, ptr, n, self._copy, self.n_groups, self._i32),
              "append")
        return [(self._copy[i].src, self._copy[i].dst) for i in range(self._i32[0])]

    def append_each(self, seq_ids: np.ndarray, token_ids: np.ndarray) -> list[tuple[int, int]] | None:
        """One token for each sequence (int32 arrays, distinct ids), all or none: the
        copy-on-write (src, dst) block copies to do, or None (nothing changed) when the pool
        may be short, where appending one by one still may fit."""
        n = len(seq_ids)
        if self._each_copies is None or len(self._each_copies) < n * self.n_groups:
            self._each_copies = ffi.new("pp_block_copy[]", max(64, 2 * n * self.n_groups))
        status = lib.pp_seq_append_each(self._live, ffi.cast("const int32_t *", ffi.from_buffer(seq_ids)),
                                        ffi.cast("const int32_t *", ffi.from_buffer(token_ids)), n,
                                        self._each_copies, len(self._each_copies), self._i32)
        if status == PP_ERR_OUT_OF_BLOCKS:
            return None
        check(status, "append_each")
        return [(self._each_copies[i].src, self._each_copies[i].dst) for i in range(self._i32[0])]

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks that appending num_tokens would take (copy-on-write included)."""
        check(lib.pp_seq_blocks_needed(self._live, seq_id, num_tokens, self._i32),
              "blocks_needed")
        return self._i32[0]

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Record that the KV of the first num_tokens tokens is written (cacheable)."""
        check(lib.pp_seq_mark_computed(self._live, seq_id, num_tokens), "mark_computed")

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of seq_id; returns its id."""
        check(lib.pp_seq_fork(self._live, seq_id, self._i32), "fork")
        return self._i32[0]

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (full hashed blocks stay cached)."""
        check(lib.pp_seq_free(self._live, seq_id), "free")

    def length(self, seq_id: int) -> int:
        """Number of tokens in a sequence."""
        check(lib.pp_seq_length(self._live, seq_id, self._i32), "length")
        return self._i32[0]

    def block_table(self, seq_id: int, group: int = 0) -> np.ndarray:
        """The sequence's physical block ids in logical order, in one layer group
        (-1 where a window group gave a block back)."""
        return self._read_ids(lambda *a: lib.pp_seq_group_block_table(a[0], a[1], group, *a[2:]), seq_id,
                              "block_table")

    def tokens(self, seq_id: int) -> np.ndarray:
        """The sequence's token ids."""
        return self._read_ids(lib.pp_seq_tokens, seq_id, "tokens")

    def slot_mapping(self, seq_id: int, start: int, count: int) -> np.ndarray:
        """KV slots (block_id * block_size + offset) of positions [start, start+count)."""
        out = np.empty(count, dtype=np.int32)
        check(lib.pp_seq_slot_mapping(self._live, seq_id, start, count,
                                      ffi.cast("int32_t *", ffi.from_buffer(out))),
              "slot_mapping")
        return out

    def _read_ids(self, fn, seq_id: int, what: str) -> np.ndarray:
        # First call sizes the array (PP_ERR_CAPACITY still reports the count).
        status = fn(self._live, seq_id, ffi.NULL, 0, self._i32)
        if status not in (lib.PP_OK, lib.PP_ERR_CAPACITY):
            check(status, what)
        out = np.empty(self._i32[0], dtype=np.int32)
        check(fn(self._live, seq_id, ffi.cast("int32_t *", ffi.from_buffer(out)), len(out),
                 self._i32), what)
        return out
