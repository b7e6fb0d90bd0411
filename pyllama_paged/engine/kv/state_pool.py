"""StatePool: Python face of the native recurrent state pool of a hybrid model (Qwen3.5/3.6's
Gated DeltaNet layers): one fixed-size slot per running sequence beside the KV block pool,
holding every linear layer's convolution and delta-rule state. Holds no policy: who gets a
slot, and when it is copied, zeroed or freed, the caller decides."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..._native import check, ffi, lib
from ..._native.handle import NativeHandle
from ...errors import OutOfBlocksError, PagedError


def state_bytes_per_sequence(model_native) -> int:
    """Bytes of one sequence's recurrent state under a native model (0: no recurrent layers)."""
    return int(lib.pp_model_state_bytes(model_native))


# At most this share of a KV budget goes to state slots beyond the n_seq_max sequences and the
# checkpoints it was sized for: the rest stays pages (a long context needs them as much as a new
# sequence a slot). Half: a hybrid's state is large against its KV (Qwen3.6-35B-A3B's 63 MiB is
# about 3,200 tokens of its KV), so a server's default 32k-token budget buys 5 slots (3 sequences,
# 2 checkpoints) and 16k tokens of pages.
STATE_SHARE = 0.5


def split_budget(budget: int, state_bytes: int, n_seq_max: int, max_num_seqs: int,
                 checkpoints: int = 0) -> tuple[int, int, int]:
    """A hybrid's KV budget in bytes cut into (running slots, checkpoint slots, bytes left for
    KV pages): a slot for each of the n_seq_max sequences it was sized for and for each of the
    checkpoints (prefix caching), more for sequences up to STATE_SHARE of the budget, never
    more than max_num_seqs (the scheduler's limit of sequences running at once)."""
    share = int(budget * STATE_SHARE) // state_bytes
    total = max(max(1, n_seq_max) + checkpoints, min(max_num_seqs + checkpoints, share))
    left = budget - total * state_bytes
    if left <= 0:
        raise PagedError(f"a KV budget of {budget} bytes holds no KV pages beside {total} recurrent state "
                         f"slot(s) of {state_bytes} bytes ({checkpoints} of them for prefix-cache checkpoints): "
                         "give the engine a larger budget")
    return total - checkpoints, checkpoints, left


def hybrid_slots(config, state_bytes: int, budget: int, slab_bytes: int) -> tuple[int, int, int]:
    """A hybrid's (running state slots, checkpoint slots, KV bytes left) for an EngineConfig
    and its KV budget in bytes: config.state_slots if given (the budget then all KV), else
    split_budget's, a budget derived from n_seq_max grown by those slots' states so those
    sequences keep their KV; paged=False (no prefix cache, so no checkpoints) gives no more
    slots than the slabs of slab_bytes the rest buys."""
    checkpoints = config.state_checkpoints if config.paged else 0
    if config.state_slots is not None:
        return config.state_slots, checkpoints, budget
    if not config.kv_budget_given:
        budget += (config.n_seq_max + checkpoints) * state_bytes
    running, checkpoints, budget = split_budget(budget, state_bytes, config.n_seq_max,
                                                config.scheduler.max_num_seqs, checkpoints)
    if not config.paged:
        running = min(running, max(1, budget // slab_bytes))
    return running, checkpoints, budget


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


class _Checkpoint:
    """A state slot holding a sequence's recurrent state after its first len(tokens) tokens."""

    __slots__ = ("slot", "tokens", "restored")

    def __init__(self, slot: int, tokens: np.ndarray):
        self.slot = slot
        self.tokens = tokens          # int32: the prefix the state is of (checked on a hit)
        self.restored = 0             # sequences that started from it


def _no_lora(lora) -> None:
    """A hybrid's sequences run no LoRA adapter (their states and checkpoints know none)."""
    if lora is not None:
        raise PagedError("LoRA adapters are not supported on hybrid models yet")


class HybridKV:
    """A KV manager (PagedKV or SlabKV) whose every sequence also holds a slot of a StatePool:
    taken when the sequence is made, copied when it is forked, given back when it is freed.
    Everything else is the wrapped manager's.

    Prefix caching (pages only, checkpoint_slots > 0): a cached prefix is reused only up to a
    block boundary where a state checkpoint exists, a copy of a sequence's state after the
    first k full blocks, keyed by block k's hash (the chain of every token before it) and
    checked against those tokens. A step that leaves a sequence at a block boundary saves
    one: its prefill chunks end there (aligned_chunk) and a decode crosses one every
    block_size tokens. A sequence keeps its checkpoint at its prompt's last full block and
    its latest other one (an earlier one goes unless another sequence started from it).
    Checkpoints live in the pool's spare slots (checkpoint_slots of them beside the
    running_slots, and any slot no sequence holds), least recently used given up first when
    a sequence needs a slot. No KV events are reported: a router cannot see which prefixes
    have a checkpoint."""

    def __init__(self, kv, states: StatePool, checkpoint_slots: int = 0, checkpoint_every: int = 0):
        if not 0 <= checkpoint_slots < states.num_slots:
            raise PagedError(f"{checkpoint_slots} checkpoint slots leave no state slot of {states.num_slots} "
                             "for a running sequence")
        self.kv = kv
        self.states = states
        self.checkpoint_slots = checkpoint_slots
        # sequences that may hold a slot at once (the scheduler's limit): the rest are for checkpoints
        self.running_slots = states.num_slots - checkpoint_slots
        self.checkpoints_on = kv.paged and checkpoint_slots > 0
        # a prefill also stops every this many blocks of its prompt, and keeps the checkpoint
        # there (a long shared system prompt; 0: only the sequence's latest other one is kept)
        self.checkpoint_every = checkpoint_every
        self._slot: dict[int, int] = {}   # handle -> state slot
        self._ckpt: OrderedDict[int, _Checkpoint] = OrderedDict()   # block hash -> checkpoint, LRU first
        # (handle, at its prompt's last full block) -> the key of the checkpoint it saved last so
        self._saved: dict[tuple[int, bool], int] = {}
        self._prompt_blocks: dict[int, int] = {}   # handle -> its prompt's full blocks a hit may reach
        # handle -> its state before a speculative step's draft: a slot, or a host copy
        self._held: dict[int, int | np.ndarray] = {}
        self.checkpoint_saves = 0         # checkpoints written
        self.checkpoint_hits = 0          # sequences that started from one
        self.checkpoint_hit_tokens = 0    # the tokens those did not compute

    def __getattr__(self, name):
        return getattr(self.kv, name)

    # ---- slots ---------------------------------------------------------------
    def _take_slot(self) -> int:
        """A free slot, zeroed; a checkpoint's (least recently used first) when none is free.
        OutOfBlocksError when every slot is a sequence's."""
        while True:
            try:
                return self.states.alloc()
            except OutOfBlocksError:
                if not self._ckpt:
                    raise
                self.states.free(self._ckpt.popitem(last=False)[1].slot)

    def _with_slot(self, handle: int) -> int:
        """handle with a state slot of its own; with none left the sequence is freed and
        OutOfBlocksError raised (nothing changes)."""
        try:
            self._slot[handle] = self._take_slot()
        except PagedError:
            self.kv.free(handle)
            raise
        return handle

    # ---- sequences -----------------------------------------------------------
    def create(self, token_ids, lora=None) -> tuple[int, int]:
        """A sequence holding token_ids in new blocks: (handle, 0 tokens cached). lora must be
        None (LLMEngine.add_lora refuses adapters for hybrids)."""
        _no_lora(lora)
        return self._with_slot(self.kv.create_uncached(token_ids)), 0

    def create_cached(self, token_ids, lora=None) -> tuple[int, int]:
        """A sequence holding the longest cached prefix of token_ids that ends at a state
        checkpoint, its state restored from it (pages: the rest is placed chunk by chunk; a
        slab holds every token, none computed): (handle, tokens it holds)."""
        _no_lora(lora)
        if not self.kv.paged:
            handle, held = self.kv.create_cached(token_ids)
            return self._with_slot(handle), held
        bs = self.kv.block_size
        candidates = self._checkpoints_along(token_ids)   # [(blocks, key, checkpoint)], longest first
        for blocks, key, ckpt in candidates:
            handle, held = self.kv.create_cached(token_ids[:blocks * bs + 1])
            if held == blocks * bs:
                self._restore(handle, key, ckpt)
                return handle, held
            self.kv.free(handle)   # its pages went from the cache: try a shorter prefix
            candidates = [c for c in candidates if c[0] * bs <= held]
        handle, held = self.kv.create_cached(token_ids[:0])
        return self._with_slot(handle), held

    def _restore(self, handle: int, key: int, ckpt: "_Checkpoint") -> None:
        """Give the new sequence handle a slot holding checkpoint ckpt's state: a copy, or
        ckpt's own slot when no other is free (the checkpoint is then used up)."""
        self._ckpt.move_to_end(key)   # the last a new slot would take
        if self.states.num_free == 0 and next(iter(self._ckpt)) == key:
            del self._ckpt[key]
            self._slot[handle] = ckpt.slot
        else:
            self._with_slot(handle)
            self.states.copy(ckpt.slot, self._slot[handle])
        ckpt.restored += 1
        self.checkpoint_hits += 1
        self.checkpoint_hit_tokens += len(ckpt.tokens)

    def _checkpoints_along(self, token_ids) -> list[tuple[int, int, "_Checkpoint"]]:
        """The checkpoints of token_ids' prefixes a hit may reach (never the last token's
        block), as (full blocks, key, checkpoint), longest first."""
        if not self.checkpoints_on or not self._ckpt:
            return []
        bs, pool = self.kv.block_size, self.kv.pool
        tokens = np.asarray(token_ids, dtype=np.int32)
        found, key = [], 0
        for k in range(1, (len(tokens) - 1) // bs + 1):
            key = pool.hash_block(key, tokens[(k - 1) * bs:k * bs])
            ckpt = self._ckpt.get(key)
            if ckpt is not None and np.array_equal(ckpt.tokens, tokens[:k * bs]):
                found.append((k, key, ckpt))
        return found[::-1]

    def create_uncached(self, token_ids, lora=None) -> int:
        _no_lora(lora)
        return self._with_slot(self.kv.create_uncached(token_ids))

    def fork(self, handle: int) -> int:
        """A sequence sharing handle's pages, its state a copy of handle's."""
        child = self._with_slot(self.kv.fork(handle))
        self.states.copy(self._slot[handle], self._slot[child])
        return child

    def free(self, handle: int) -> None:
        self.release_state(handle)
        self.kv.free(handle)
        self.states.free(self._slot.pop(handle))
        self._saved.pop((handle, False), None)
        self._saved.pop((handle, True), None)
        self._prompt_blocks.pop(handle, None)

    def state_slot(self, handle: int) -> int:
        return self._slot[handle]

    def state_slots(self, handles) -> np.ndarray:
        """The state slot of each handle (a step's sequence rows), as int32."""
        try:
            return np.fromiter((self._slot[h] for h in np.asarray(handles).tolist()), np.int32, len(handles))
        except KeyError as e:
            raise PagedError(f"sequence {e.args[0]} holds no state slot") from None

    # ---- speculative decoding: the state before a draft ----------------------------
    def hold_state(self, handle: int) -> None:
        """Keep handle's state as it is now, for roll_back_state after a step that may run
        rejected draft tokens through it: in a free slot (a device copy), else on the host
        (no checkpoint is given up for it)."""
        self.release_state(handle)
        slot = self._slot[handle]
        if self.states.num_free > 0:
            held = self.states.alloc()
            self.states.copy(slot, held)
            self._held[handle] = held
        else:
            self._held[handle] = self.states.read(slot)

    def roll_back_state(self, handle: int) -> None:
        """handle's state back to the one hold_state kept (which is then released)."""
        held = self._held.pop(handle)
        if isinstance(held, np.ndarray):
            self.states.write(self._slot[handle], held)
        else:
            self.states.copy(held, self._slot[handle])
            self.states.free(held)

    def release_state(self, handle: int) -> None:
        """Forget the state hold_state kept for handle, if any."""
        held = self._held.pop(handle, None)
        if held is not None and not isinstance(held, np.ndarray):
            self.states.free(held)

    # ---- checkpoints -----------------------------------------------------------
    def aligned_chunk(self, num_computed: int, n: int, num_tokens: int, handle: int | None = None) -> int:
        """How many of the next n prefill tokens of a sequence holding num_computed of
        num_tokens to compute in one step so that it stops where a checkpoint is worth
        saving: a chunk that does not end the tokens ends at a block boundary, and the last
        one stops first at the last block boundary a later prompt could hit (the block
        before the last token's), where sequence handle's checkpoint is then kept beside its
        latest. Never 0 when n is not."""
        if not self.checkpoints_on or n <= 0:
            return n
        bs = self.kv.block_size
        last = (num_tokens - 1) // bs * bs
        if handle is not None and last > num_computed:
            self._prompt_blocks[handle] = last // bs
        end = num_computed + n
        aligned = end // bs * bs if end < num_tokens else last
        every = self.checkpoint_every * bs
        if every and num_computed // every < last // every:   # a multiple of `every` before the last
            aligned = min(aligned, (num_computed // every + 1) * every)
        return aligned - num_computed if aligned > num_computed else n

    def commit_batch(self, items: np.ndarray, item_pointer=None) -> None:
        """The wrapped manager's commit (the step's full blocks enter the prefix cache), then
        a checkpoint of every sequence the step left at a block boundary."""
        self.kv.commit_batch(items, item_pointer)
        if not self.checkpoints_on:
            return
        bs = self.kv.block_size
        for handle, start, count in np.asarray(items).reshape(-1, 3).tolist():
            end = start + count
            if end % bs == 0 and end > 0 and handle in self._slot:
                self._save(handle, end // bs)

    def _save(self, handle: int, blocks: int) -> None:
        """Checkpoint handle's state after its first `blocks` full blocks, in place of the one
        of the same kind (at its prompt's last full block, or any other) it saved last unless
        another sequence started from that."""
        info = self.kv.pool.block_info(int(self.kv.block_table(handle)[blocks - 1]))
        if info.hash is None:
            return
        key = info.hash
        kind = (handle, self._prompt_blocks.get(handle) == blocks)
        if self.checkpoint_every and blocks % self.checkpoint_every == 0 and \
                blocks < self._prompt_blocks.get(handle, 0):
            kind = None   # kept: replaced by none of the sequence's later ones
        old_key = self._saved.get(kind)
        old = self._ckpt.get(old_key) if old_key is not None else None
        if key in self._ckpt:   # the same prefix saved already (its state is the same)
            self._ckpt.move_to_end(key)
            return
        if old is not None and old.restored == 0:
            del self._ckpt[old_key]
            slot = old.slot
        else:
            slot = self._spare_slot()
            if slot is None:
                return
        self.states.copy(self._slot[handle], slot)
        tokens = self.kv.pool.tokens(handle)[:blocks * self.kv.block_size].astype(np.int32, copy=True)
        self._ckpt[key] = _Checkpoint(slot, tokens)
        if kind is not None:
            self._saved[kind] = key
        self.checkpoint_saves += 1

    def _spare_slot(self) -> int | None:
        """A slot for a new checkpoint: a free one, else the least recently used checkpoint's
        (None: every slot is a sequence's)."""
        if self.states.num_free > 0:
            return self.states.alloc()
        if self._ckpt:
            return self._ckpt.popitem(last=False)[1].slot
        return None

    @property
    def num_checkpoints(self) -> int:
        return len(self._ckpt)

    def drop_checkpoints(self) -> None:
        """Give every checkpoint's slot back."""
        while self._ckpt:
            self.states.free(self._ckpt.popitem(last=False)[1].slot)
        self._saved.clear()
        self._prompt_blocks.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, and so every checkpoint."""
        self.kv.reset_prefix_cache()
        self.drop_checkpoints()

    def watch_cache(self, listener) -> None:
        """A router would see cached pages, not which prefixes have a state checkpoint."""
        if listener is not None:
            raise PagedError("KV events: a hybrid model reuses a cached prefix only where its recurrent state "
                             "was checkpointed, which the events do not report")

    def close(self) -> None:
        """The block pool and the state pool (the compute context that used them is gone)."""
        self._ckpt.clear()
        self._held.clear()
        self.kv.close()
        self.states.close()
