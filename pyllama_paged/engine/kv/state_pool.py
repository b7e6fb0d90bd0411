"""StatePool: Python face of the native recurrent state pool of a hybrid model (Qwen3.5/3.6's
Gated DeltaNet layers): one fixed-size slot per running sequence beside the KV block pool,
holding every linear layer's convolution and delta-rule state. Holds no policy: who gets a
slot, and when it is copied, zeroed or freed, the caller decides."""

from __future__ import annotations

import numpy as np

from ..._native import check, ffi, lib
from ..._native.handle import NativeHandle
from ...errors import PagedError


def state_bytes_per_sequence(model_native) -> int:
    """Bytes of one sequence's recurrent state under a native model (0: no recurrent layers)."""
    return int(lib.pp_model_state_bytes(model_native))


# At most this share of a KV budget goes to state slots beyond the n_seq_max sequences it was
# sized for: the rest stays pages (a long context needs them as much as a new sequence a slot).
# Half: a hybrid's state is large against its KV (Qwen3.6-35B-A3B's 63 MiB is about 3,200 tokens
# of its KV), so a server's default 32k-token budget buys 5 slots and 16k tokens of pages.
STATE_SHARE = 0.5


def split_budget(budget: int, state_bytes: int, n_seq_max: int, max_num_seqs: int) -> tuple[int, int]:
    """A hybrid's KV budget in bytes cut into (state slots, bytes left for KV pages): a slot for
    each of the n_seq_max sequences it was sized for, more up to STATE_SHARE of the budget, never
    more than max_num_seqs (the scheduler's limit of sequences running at once)."""
    extra = int(budget * STATE_SHARE) // state_bytes
    slots = max(1, min(max_num_seqs, max(n_seq_max, extra)))
    left = budget - slots * state_bytes
    if left <= 0:
        raise PagedError(f"a KV budget of {budget} bytes holds no KV pages beside {slots} recurrent state "
                         f"slot(s) of {state_bytes} bytes: give the engine a larger budget")
    return slots, left


class StatePool(NativeHandle):
    """num_slots state slots for the native model model_native (which must outlive the pool)."""

    _destroy = staticmethod(lib.pp_state_pool_destroy)

    def __init__(self, model_native, num_slots: int):
        out = ffi.new("pp_state_pool **")
        check(lib.pp_state_pool_create(model_native, num_slots, out), "state pool")
        self._handle = out[0]
        self.num_slots = num_slots
        self.bytes_per_slot = int(lib.pp_state_pool_bytes_per_slot(self._handle))
        self._slot = ffi.new("int32_t *")

    @property
    def native(self):
        """The pp_state_pool handle (valid until close)."""
        if self._handle is None:
            raise PagedError("the state pool is closed")
        return self._handle

    @property
    def num_free(self) -> int:
        return int(lib.pp_state_pool_num_free(self._handle)) if self._handle is not None else 0

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.bytes_per_slot * self.num_slots

    def alloc(self) -> int:
        """A free slot, zeroed (OutOfBlocksError when every slot is taken: nothing changes)."""
        check(lib.pp_state_pool_alloc(self.native, self._slot), "state slot")
        return int(self._slot[0])

    def free(self, slot: int) -> None:
        check(lib.pp_state_pool_free(self.native, slot), "free state slot")

    def copy(self, src: int, dst: int) -> None:
        """Slot src's state over slot dst's (a fork)."""
        check(lib.pp_state_pool_copy(self.native, src, dst), "copy state slot")

    def zero(self, slot: int) -> None:
        """The state of a sequence with no token yet (recompute from the first token)."""
        check(lib.pp_state_pool_zero(self.native, slot), "zero state slot")

    def read(self, slot: int) -> np.ndarray:
        """A host copy of one slot's state (bytes; the layout pyllama_paged.h gives)."""
        out = np.empty(self.bytes_per_slot, dtype=np.uint8)
        check(lib.pp_state_pool_read(self.native, slot, ffi.from_buffer(out)), "read state slot")
        return out

    def write(self, slot: int, data: np.ndarray) -> None:
        """Restore one slot's state from a host copy (read's)."""
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if data.size != self.bytes_per_slot:
            raise PagedError(f"a state slot holds {self.bytes_per_slot} bytes, not {data.size}")
        check(lib.pp_state_pool_write(self.native, slot, ffi.from_buffer(data)), "write state slot")


class HybridKV:
    """A KV manager (PagedKV or SlabKV) whose every sequence also holds a slot of a StatePool:
    taken when the sequence is made, copied when it is forked, given back when it is freed.
    Everything else is the wrapped manager's. A sequence starts with no cached prefix: its
    recurrent state at a cached block is not kept (checkpoints would), so the prefix cache is
    never looked up; and no KV events are reported, since no prefix would be reused."""

    def __init__(self, kv, states: StatePool):
        self.kv = kv
        self.states = states
        self._slot: dict[int, int] = {}   # handle -> state slot

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def _with_slot(self, handle: int) -> int:
        """handle with a state slot of its own; with none left the sequence is freed and
        OutOfBlocksError raised (nothing changes)."""
        try:
            self._slot[handle] = self.states.alloc()
        except PagedError:
            self.kv.free(handle)
            raise
        return handle

    def create(self, token_ids) -> tuple[int, int]:
        """A sequence holding token_ids in new blocks: (handle, 0 tokens cached)."""
        return self._with_slot(self.kv.create_uncached(token_ids)), 0

    def create_cached(self, token_ids) -> tuple[int, int]:
        """A sequence holding nothing yet (pages: its tokens are placed chunk by chunk; a slab
        holds them all, none computed): (handle, tokens it holds)."""
        handle, held = self.kv.create_cached(token_ids if not self.kv.paged else token_ids[:0])
        return self._with_slot(handle), held

    def create_uncached(self, token_ids) -> int:
        return self._with_slot(self.kv.create_uncached(token_ids))

    def fork(self, handle: int) -> int:
        """A sequence sharing handle's pages, its state a copy of handle's."""
        child = self._with_slot(self.kv.fork(handle))
        self.states.copy(self._slot[handle], self._slot[child])
        return child

    def free(self, handle: int) -> None:
        self.kv.free(handle)
        self.states.free(self._slot.pop(handle))

    def state_slot(self, handle: int) -> int:
        return self._slot[handle]

    def state_slots(self, handles) -> np.ndarray:
        """The state slot of each handle (a step's sequence rows), as int32."""
        try:
            return np.fromiter((self._slot[h] for h in np.asarray(handles).tolist()), np.int32, len(handles))
        except KeyError as e:
            raise PagedError(f"sequence {e.args[0]} holds no state slot") from None

    def watch_cache(self, listener) -> None:
        """No prefix of a hybrid is ever reused: nothing to report to a router."""
        if listener is not None:
            raise PagedError("KV events: a hybrid model (recurrent state per sequence) reuses no cached "
                             "prefix, so it has none to report")

    def close(self) -> None:
        """The block pool and the state pool (the compute context that used them is gone)."""
        self.kv.close()
        self.states.close()
