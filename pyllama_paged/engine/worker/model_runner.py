"""ModelRunner: one model's native KV pools and compute context, and the
batched forward step over any mix of sequences (each with any number of new
tokens). The KV manager builds a step's flat arrays (tokens, positions,
slot_mapping, seq_index, block_tables, logit rows) into buffers reused
across steps: for pages, in one native call."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..._native import check, ffi, lib
from ...errors import PagedError
from ..kv.groups import KVGroups
from ..kv.manager import PagedKV, SeqState, SlabKV, commit_chunks, fork_state, new_cached_sequence, place_tokens
from ..kv.state_pool import HybridKV, StatePool, hybrid_slots, state_bytes_per_sequence
from .model import Model
from .draft_splice import splice_drafts
from .lora import StepLoras
from ..kv.step_batch import StepBuffers
from .thread_policy import ThreadPolicy

KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml_type ids
# Paged attention: our CPU operator, or GGML ops alone (pages gathered by slot, then GGML's
# flash attention: the portable path for any backend).
ARGMAX_MODES = {"device": lib.PP_ARGMAX_ON_DEVICE, "always": lib.PP_ARGMAX_ALWAYS,
                "never": lib.PP_ARGMAX_NEVER}   # enum pp_argmax_mode
ATTENTION_PATHS = {"kernel": lib.PP_ATTENTION_KERNEL, "gather": lib.PP_ATTENTION_GATHER}   # enum pp_attention_path
_KV_ROW = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}   # (values, bytes) per quantization group


def kv_row_bytes(kv_cache_type: str, n_values: int) -> int:
    """Bytes of one K (or V) row of n_values in a KV cache type."""
    per, size = _KV_ROW[kv_cache_type]
    return n_values // per * size


def dense_kv_bytes_per_token(config, kv_cache_type: str) -> int:
    """K+V bytes of one token over every attention layer that keeps its own KV: what a cache that
    frees nothing holds."""
    return sum(2 * kv_row_bytes(kv_cache_type, config.kv_values(il)) for il in range(config.n_layer)
               if config.owns_kv(il))


def kv_groups_for(config, paged: bool, free_window_blocks: bool) -> KVGroups:
    """The model's layer groups: sliding-window layers apart (their blocks given back) when
    paged and freeing, else one group; layers reading another's KV in their source's."""
    if not (paged and free_window_blocks):
        return KVGroups.single(config.n_layer)
    return KVGroups.for_layers(config.layer_window, [config.kv_values(il) for il in range(config.n_layer)],
                               config.layer_kv_source)


def _ptr(arr: np.ndarray, ctype: str = "int32_t *"):
    return ffi.cast(ctype, ffi.from_buffer(arr))


class ModelRunner:
    """A model, where its sequences' KV lives (pages or slabs), and the step that computes them."""

    def __init__(self, model: Model, config):
        """config: an EngineConfig (engine/config.py) whose n_ctx is the exact context per
        sequence; the pool holds num_blocks pages if given, else its KV budget
        (EngineConfig.kv_budget_bytes): pages of block_size tokens, or (paged=False) as many
        whole n_ctx slabs; a hybrid's recurrent state slots (state_slots, or out of that budget)
        and its prefix-cache checkpoints' (state_checkpoints) beside them. n_threads, n_batch,
        kv_cache_type, free_window_blocks and attention shape the rest."""
        paged, n_ctx, n_batch, block_size = config.paged, config.n_ctx, config.n_batch, config.block_size
        n_threads, kv_cache_type, attention = config.n_threads, config.kv_cache_type, config.attention
        if n_ctx < 1 or n_batch < 1 or config.n_seq_max < 1:
            raise PagedError("n_ctx, n_batch and n_seq_max must be >= 1")
        if paged and not 1 <= block_size <= 1024:
            raise PagedError(f"block_size {block_size} out of range [1, 1024]")
        if attention not in ATTENTION_PATHS:
            raise PagedError(f"attention '{attention}' unknown: choose one of {', '.join(ATTENTION_PATHS)}")
        if kv_cache_type not in KV_TYPES:
            raise PagedError(f"kv_cache_type '{kv_cache_type}' unsupported: choose one of "
                             f"{', '.join(KV_TYPES)}")
        self.model = model
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_threads = n_threads
        # set by the engine when the thread count was not fixed: each step then runs on the
        # cores free at that moment (thread_policy.py), at most n_threads
        self.thread_policy: ThreadPolicy | None = None
        self.kv_cache_type = kv_cache_type
        self._cache = None
        self._ctx = None
        cfg = model.config
        # Sliding-window layers get their own block tables and give pages back
        # (kv_groups.py); free_window_blocks=False keeps every layer's KV.
        self.kv_groups = kv_groups_for(cfg, paged, config.free_window_blocks)
        dense_token_bytes = dense_kv_bytes_per_token(cfg, kv_cache_type)
        # the same KV bytes for pages and for the slab baseline, unless the pages are counted
        budget = config.kv_budget_bytes(n_ctx, dense_token_bytes)
        if cfg.is_hybrid:   # a hybrid's recurrent state slots come out of the same budget first
            running, checkpoints, budget = hybrid_slots(config, state_bytes_per_sequence(model.native), budget,
                                                        n_ctx * dense_token_bytes)
        if paged:
            # the rows the layers that keep their own KV put in a slot (not shared-KV or recurrent ones)
            kv_values = [cfg.kv_values(il) if cfg.owns_kv(il) else 0 for il in range(cfg.n_layer)]
            slot_bytes = 2 * kv_row_bytes(kv_cache_type, self.kv_groups.slot_values(kv_values))
            num_blocks = config.num_blocks or max(1, budget // (slot_bytes * block_size))
            self.kv = PagedKV(num_blocks, block_size, n_ctx, self.kv_groups)
        else:
            self.kv = SlabKV(max(1, budget // (n_ctx * dense_token_bytes)), n_ctx)
        if cfg.is_hybrid:   # a slot per sequence that may run at once, and the checkpoints'
            self.kv = HybridKV(self.kv, StatePool(model.native, running + checkpoints), checkpoints,
                               config.state_checkpoint_every)
        out = ffi.new("pp_kv_cache **")
        layer_group = ffi.new("int32_t[]", list(self.kv_groups.layer_group))
        check(lib.pp_kv_cache_create_grouped(model.native, KV_TYPES[kv_cache_type], self.kv.num_blocks,
                                             self.kv.block_size, int(paged), self.kv_groups.n_groups,
                                             layer_group, out), "KV cache")
        self._cache = out[0]
        ctx = ffi.new("pp_context **")
        check(lib.pp_context_create(model.native, self._cache, n_threads, n_batch, ctx), "context")
        self._ctx = ctx[0]
        check(lib.pp_context_set_attention_path(self._ctx, ATTENTION_PATHS[attention]), "attention path")
        if self.hybrid:
            check(lib.pp_context_set_state_pool(self._ctx, self.kv.states.native), "state pool")
        self.attention = attention
        self._batch = ffi.new("pp_batch *")
        self._loras = StepLoras()
        self._buffers = StepBuffers()
        self._no_logits = np.empty((0, self.n_vocab), dtype=np.float32)
        self._no_hidden = np.empty((0, model.config.n_embd), dtype=np.float32)
        self._n_rows = ffi.new("int32_t *")
        self._logits_view = (None, 0, self._no_logits)   # (native pointer, rows, the view over it)

    @property
    def n_vocab(self) -> int:
        return self.model.config.n_vocab

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes one token takes across all layers (what a cache that frees nothing holds)."""
        return lib.pp_kv_cache_bytes_per_token(self._cache)

    @property
    def kv_slot_bytes(self) -> int:
        """K+V bytes of one slot of a block: one token of one layer group."""
        return lib.pp_kv_cache_bytes_per_slot(self._cache)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the whole KV pool."""
        return self.kv_slot_bytes * self.kv.block_size * self.kv.num_blocks

    @property
    def block_bytes(self) -> int:
        """Host bytes one block's K and V take (the layers of the group holding it)."""
        return self.kv_slot_bytes * self.kv.block_size

    @property
    def kv_device_bytes(self) -> int:
        """Bytes of the KV pools on the model's GPU (0: all in host memory)."""
        on_device = lib.pp_kv_cache_device_layers(self._cache)
        return self.kv_pool_bytes * on_device // self.model.config.n_attention_layers

    def kv_bytes_by_group(self) -> list[dict]:
        """Per layer group: its window and the KV bytes per token it costs in steady state
        (a window group's cost stops growing past its window)."""
        per_token = self.kv_slot_bytes
        groups = self.kv_groups.layer_group
        return [{"group": g, "window": w,
                 "layers": sum(1 for il in range(len(groups)) if groups[il] == g and self.model.config.attends(il)),
                 "bytes_per_token": per_token,
                 "max_tokens": (-(-(w - 1) // self.kv.block_size) + 1) * self.kv.block_size if w > 0 else None}
                for g, w in enumerate(self.kv_groups.group_window)]

    def kv_bytes_for(self, num_tokens: int) -> int:
        """KV bytes one sequence of num_tokens computed tokens holds here."""
        if not self.kv.paged:
            return self.kv_bytes_per_token * self.kv.block_size
        return self.kv_groups.steady_bytes(self.kv_slot_bytes, self.kv.block_size, num_tokens)

    def step_stats(self) -> dict:
        """The last step's graph (nodes, input tensors and their bytes, whether it was the
        previous step's graph run again) and the builds and steps so far."""
        stats = ffi.new("pp_step_stats *")
        check(lib.pp_context_step_stats(self._ctx, stats), "step stats")
        return {"nodes": stats.n_nodes, "inputs": stats.n_inputs, "input_bytes": stats.input_bytes,
                "reused": bool(stats.reused), "builds": stats.n_builds, "steps": stats.n_steps}

    def set_threads(self, n_threads: int) -> None:
        check(lib.pp_context_set_threads(self._ctx, n_threads), "set_threads")
        self.n_threads = n_threads

    def abort(self) -> None:
        """Stop the running step (or the next one) from any thread: it raises ComputeError."""
        check(lib.pp_context_abort(self._ctx), "abort")

    # ---- sequences' KV -------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """Whether the model keeps a recurrent state per sequence (a state slot beside its KV)."""
        return isinstance(self.kv, HybridKV)

    @property
    def state_pool(self) -> StatePool | None:
        """A hybrid's recurrent states, a slot per sequence (None for other models)."""
        return self.kv.states if self.hybrid else None

    def add_sequence(self, token_ids: Sequence[int], lora=None) -> SeqState:
        """Place a new sequence's tokens in the KV cache (prefix-cache hits are kept; a hybrid
        takes none here: add_sequence_cached finds its state checkpoints). lora:
        (LoraAdapter, scale) the sequence runs, or None; forks inherit it."""
        if len(token_ids) > self.n_ctx:
            raise PagedError(f"prompt of {len(token_ids)} tokens exceeds the context of {self.n_ctx}")
        handle, cached = self.kv.create(token_ids, lora)
        # The pool never counts the last token as cached: its logits start generation.
        return SeqState(handle, cached, len(token_ids))

    def add_sequence_cached(self, token_ids: Sequence[int], lora=None) -> SeqState:
        """A new sequence holding only the cached prefix of token_ids (computed); the
        rest is placed chunk by chunk with append_tokens."""
        return new_cached_sequence(self.kv, token_ids, lora)

    def add_sequence_uncached(self, token_ids: Sequence[int], lora=None) -> SeqState:
        """A new sequence holding token_ids in fresh blocks (nothing reused, nothing computed)."""
        if len(token_ids) > self.n_ctx:
            raise PagedError(f"prompt of {len(token_ids)} tokens exceeds the context of {self.n_ctx}")
        return SeqState(self.kv.create_uncached(token_ids, lora), 0, len(token_ids))

    def state_slot(self, seq: SeqState) -> int:
        """seq's state slot (hybrids)."""
        return self.kv.state_slot(seq.handle)

    def state_slots_of(self, seq: SeqState) -> list[int] | None:
        """forward()'s state_slots for a step of seq alone: [its slot] (hybrids), else None."""
        return [self.kv.state_slot(seq.handle)] if self.hybrid else None

    def append_tokens(self, seq: SeqState, token_ids: Sequence[int]) -> None:
        """Reserve KV room for new tokens (copy-on-write done here)."""
        self.copy_blocks(place_tokens(self.kv, seq, token_ids))

    def fork(self, seq: SeqState) -> SeqState:
        """A sequence sharing all of seq's KV pages (and a copy of its recurrent state)."""
        return fork_state(self.kv, seq)

    def free(self, seq: SeqState) -> None:
        """Release a sequence's KV (computed full pages stay in the prefix cache) and its state slot."""
        self.kv.free(seq.handle)

    # ---- the step ------------------------------------------------------------
    def execute(self, items: np.ndarray, hidden: Sequence[tuple[int, int] | None] | None = None,
                all_logits: Sequence[bool] | None = None,
                drafts: dict[int, list[int]] | None = None, argmax_only: bool = False,
                images: Sequence[list] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Run one step over items [(kv handle, first token, count)], whose tokens are placed in
        the KV manager. Touches no sequence state: the caller marks the tokens computed
        (Scheduler.update_from_output, or commit_chunks).

        Returns (logits, hidden). logits: a row for each item that computes its sequence's
        last placed token, in item order (a non-final prefill chunk gets none), a view of
        the compute buffer valid until the next step. hidden[i] = (first, count) marks item
        i as an embedding: it gets no logits, and the final hidden states (after the output
        norm) of its tokens [first, first + count) of this chunk come back instead, all such
        rows in item order, as a fresh [rows, n_embd] array. all_logits[i] gives item i a
        logits row for every one of its tokens (prompt scoring), in place of its one row.
        drafts[i]: draft tokens that follow item i's last token in this step only (never
        placed in the pool; worker/draft_splice.py), each with a logits row after the
        item's own. argmax_only: the caller reads only each row's argmax (step_argmax()); where
        the step computed them on a device the logits are then not read back (empty rows).
        images[i]: item i's images, (first position, embedding rows) each: the item's tokens at
        those positions take the rows as their input."""
        items = np.ascontiguousarray(items, dtype=np.int32).reshape(-1, 3)
        counts = items[:, 2].tolist()   # in Python: a few items, and numpy's reductions cost more
        total = sum(counts)
        if counts and min(counts) < 1:
            raise PagedError("every step item must compute at least one token")
        if total > self.n_batch:
            raise PagedError(f"step of {total} tokens exceeds n_batch {self.n_batch}")
        buffers = self._buffers
        buffers.reserve(total, len(items), self.kv.max_blocks_per_seq, self.kv.n_groups)
        items = buffers.items(items)
        n_tokens, n_logits = self.kv.build_batch(items, buffers)
        self._loras.fill(self._batch, items[:, 0].tolist(), self.kv.loras.of, self._reserve_loras)
        tok, pos, slots, seqs, tables, rows = buffers.arrays(n_tokens, len(items), n_logits)
        embd = image_rows(items, images, tok) if images and not drafts else None
        if self.hybrid:
            self._set_state_slots(self.kv.state_slots(items[:, 0]))
        hidden_rows = None
        hidden = hidden if hidden is not None and any(h is not None for h in hidden) else None
        all_logits = all_logits if all_logits is not None and any(all_logits) else None
        if hidden is None and all_logits is None and not drafts:
            # the arrays are the buffers' own, from their start: their pointers are cached
            self._decode(tok, pos, slots, seqs, tables, rows, None, argmax_only=argmax_only,
                         pointers=buffers.pointers, embd=embd)
            return self._step_logits(), self._no_hidden
        if hidden is not None or all_logits is not None:
            rows, hidden_rows = _select_rows(items[:, 2].tolist(), rows, hidden, all_logits)
        if drafts:
            n_drafted = sum(len(d) for d in drafts.values())
            if n_tokens + n_drafted > self.n_batch:
                raise PagedError(f"step of {n_tokens + n_drafted} tokens with drafts exceeds n_batch {self.n_batch}")
            tok, pos, slots, seqs, rows, hidden_rows = splice_drafts(
                tok, pos, slots, seqs, rows, items[:, 2], drafts, self.kv.n_groups, hidden_rows)
            embd = image_rows(items, images, tok, drafts) if images else None
        hidden_out = np.empty((0 if hidden_rows is None else len(hidden_rows), self.model.config.n_embd),
                              dtype=np.float32)
        self._decode(tok, pos, slots, seqs, tables, rows, None, hidden_rows, hidden_out, argmax_only, embd=embd)
        return self._step_logits(), hidden_out

    def _set_state_slots(self, state_slots: np.ndarray | None) -> None:
        """The next step's state slots, one per sequence row (kept alive until the next)."""
        self._state_slots = state_slots
        self._batch.state_slots = ffi.NULL if state_slots is None else _ptr(state_slots)

    def step_argmax(self) -> np.ndarray | None:
        """The last step's argmax id per logits row when the step computed them (a head on a
        device, or set_argmax("always")), else None; a view valid until the next step."""
        n_rows = ffi.new("int32_t *")
        ptr = lib.pp_context_step_argmax(self._ctx, n_rows)
        if n_rows[0] == 0:
            return None
        return np.frombuffer(ffi.buffer(ptr, 4 * n_rows[0]), dtype=np.int32)

    def set_argmax(self, mode: str) -> None:
        """Where steps compute each row's argmax: "device" (when the head runs on one: the
        default), "always" or "never"."""
        if mode not in ARGMAX_MODES:
            raise PagedError(f"argmax mode '{mode}' unknown: choose one of {', '.join(ARGMAX_MODES)}")
        check(lib.pp_context_set_argmax(self._ctx, ARGMAX_MODES[mode]), "argmax mode")

    def step(self, work: Sequence[tuple[SeqState, int]], images: Sequence[list] | None = None) -> np.ndarray:
        """Direct use without a scheduler (tests, benchmarks): compute the next n tokens of
        each (seq, n) and mark them computed; returns execute()'s logits rows. images: as
        execute's, per item."""
        for seq, n in work:
            if n < 1 or seq.num_computed + n > seq.num_tokens:
                raise PagedError(f"cannot compute {n} tokens at {seq.num_computed} of a "
                                 f"{seq.num_tokens}-token sequence")
        items = np.array([(seq.handle, seq.num_computed, n) for seq, n in work], dtype=np.int32).reshape(-1, 3)
        logits, _ = self.execute(items, images=images)
        buffers = self._buffers
        commit_chunks(self.kv, work, buffers.last_items, buffers.item_pointer(buffers.last_items))
        return logits

    def prefill(self, seq: SeqState) -> np.ndarray:
        """Compute all of seq's pending tokens in n_batch chunks; returns (a copy of) the last logits row."""
        if seq.num_computed >= seq.num_tokens:
            raise PagedError("nothing to compute: the sequence is empty")
        while seq.num_computed < seq.num_tokens:
            n = min(self.n_batch, seq.num_tokens - seq.num_computed)
            logits = self.step([(seq, n)])
        return logits[0].copy()

    def forward(self, token_ids, positions, slot_mapping, seq_index, block_tables,
                logit_rows, out: np.ndarray | None = None, state_slots=None) -> np.ndarray:
        """One native step over flat arrays; returns logits [len(logit_rows), n_vocab] as float32
        (into out when given). With layer groups, slot_mapping holds n_groups runs of the
        tokens' slots and block_tables is [n_groups, n_seqs, max_blocks] (kv.batch_arrays).
        A hybrid's step also needs each sequence row's state slot (state_slot(seq))."""
        if self.hybrid:
            if state_slots is None:
                raise PagedError("a hybrid model's step needs each sequence's state slot (state_slots)")
            self._set_state_slots(np.ascontiguousarray(state_slots, dtype=np.int32))
        arrays = [np.ascontiguousarray(a, dtype=np.int32) for a in
                  (token_ids, positions, slot_mapping, seq_index, logit_rows)]
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        if tables.ndim == 2:
            tables = tables[None]
        if tables.ndim != 3:
            raise PagedError("block_tables must be [n_seqs, max_blocks] or [n_groups, n_seqs, max_blocks]")
        tok, pos, slots, seqs, rows = arrays
        n = len(tok)
        if not (len(pos) == len(seqs) == n and len(slots) == n * tables.shape[0]):
            raise PagedError("token_ids, positions, slot_mapping and seq_index differ in length")
        if self._ctx is None:
            raise PagedError("this model runner is closed")
        logits = np.empty((len(rows), self.n_vocab), dtype=np.float32) if out is None else out
        if logits.shape != (len(rows), self.n_vocab) or logits.dtype != np.float32 or not logits.flags.c_contiguous:
            raise PagedError("the logits buffer does not match the rows asked for")
        self._batch.n_loras = 0
        self._decode(tok, pos, slots, seqs, tables, rows, logits)
        return logits

    def _reserve_loras(self, n: int) -> None:
        check(lib.pp_context_reserve_loras(self._ctx, n), "LoRA adapters")

    def _step_logits(self) -> np.ndarray:
        """The last step's logits rows where GGML left them (no copy): valid until the next step."""
        ptr = lib.pp_context_step_logits(self._ctx, self._n_rows)
        n_rows = self._n_rows[0]
        if n_rows == 0:
            return self._no_logits
        last_ptr, last_rows, view = self._logits_view
        if ptr != last_ptr or n_rows != last_rows:   # a reused graph leaves them where they were
            view = np.frombuffer(ffi.buffer(ptr, 4 * n_rows * self.n_vocab), dtype=np.float32).reshape(
                n_rows, self.n_vocab)
            self._logits_view = (ptr, n_rows, view)
        return view

    def _decode(self, tok, pos, slots, seqs, tables, rows, logits: np.ndarray | None, hidden_rows=None,
                hidden: np.ndarray | None = None, argmax_only: bool = False, pointers: tuple = (),
                embd: tuple | None = None) -> None:
        """The native step over contiguous int32 arrays, logits into a matching float32 buffer
        (None: left in place for _step_logits), and the hidden states of hidden_rows into hidden.
        pointers: the six arrays' data as cdata when the caller holds them (StepBuffers.pointers).
        embd: (batch rows, their input embeddings) replacing those rows' token lookups."""
        if self._ctx is None:
            raise PagedError("this model runner is closed")
        self.model.native   # raises if the model was closed under us (its weights are gone)
        n = len(tok)
        b = self._batch
        b.n_tokens = n
        if not pointers:
            pointers = (_ptr(tok), _ptr(pos), _ptr(slots), _ptr(seqs), _ptr(tables),
                        _ptr(rows) if len(rows) else ffi.NULL)
        b.token_ids, b.positions, b.slot_mapping, b.seq_index, b.block_tables, b.logit_rows = pointers
        b.n_groups, b.n_seqs, b.max_blocks_per_seq = tables.shape
        b.n_logits = len(rows)
        n_hidden = 0 if hidden_rows is None else len(hidden_rows)
        b.n_hidden = n_hidden
        b.hidden_rows = _ptr(hidden_rows) if n_hidden else ffi.NULL
        b.hidden = _ptr(hidden, "float *") if n_hidden else ffi.NULL
        b.argmax_only = int(argmax_only)
        b.n_embd_rows = 0 if embd is None else len(embd[0])
        b.embd_rows = _ptr(embd[0]) if embd is not None else ffi.NULL
        b.embd = _ptr(embd[1], "float *") if embd is not None else ffi.NULL
        policy = self.thread_policy
        if policy is not None:
            threads = policy.threads_for_step(n)
            if threads != self.n_threads:
                self.set_threads(threads)   # a new GGML pool: microseconds, against a step's milliseconds
            started = time.perf_counter()
        check(lib.pp_context_decode(self._ctx, b, ffi.NULL if logits is None else _ptr(logits, "float *")),
              "forward")
        if policy is not None:
            policy.record(threads, time.perf_counter() - started, n)

    # ---- KV pages as data ----------------------------------------------------
    def copy_blocks(self, copies) -> None:
        """Perform copy-on-write block copies [(src, dst), ...] in the KV pools."""
        if not copies:
            return
        arr = ffi.new("pp_block_copy[]", [{"src": s, "dst": d} for s, d in copies])
        check(lib.pp_kv_cache_copy_blocks(self._cache, arr, len(copies)), "copy_blocks")

    def read_block(self, block_id: int) -> np.ndarray:
        """A host copy of one block's K and V (all layers): the swap-out copy."""
        out = np.empty(self.block_bytes, dtype=np.uint8)
        check(lib.pp_kv_cache_read_block(self._cache, block_id, ffi.from_buffer(out)), "read_block")
        return out

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        """Restore one block's K and V from a host copy (swap-in)."""
        check(lib.pp_kv_cache_write_block(self._cache, block_id, ffi.from_buffer(data)), "write_block")

    def close(self) -> None:
        """Free the compute context, the KV pools and the block pool (a hybrid's state pool with it)."""
        if self._ctx is not None:
            lib.pp_context_destroy(self._ctx)
            self._ctx = None
        if self._cache is not None:
            lib.pp_kv_cache_destroy(self._cache)
            self._cache = None
            self.kv.close()

    def __del__(self):
        if hasattr(self, "_ctx"):   # a constructor that refused its arguments made nothing to free
            self.close()



def image_rows(items: np.ndarray, images: Sequence[list | None], tok: np.ndarray, drafts=None):
    """(batch rows, their embedding rows) of the items' image positions, or None: each item's
    tokens are consecutive batch rows from its first position (then its drafts[i], if any),
    and where an image covers them the rows take its embeddings. Their token ids (negative)
    become 0, a row GGML may look up before the embedding replaces it."""
    at, rows, embd = 0, [], []
    for i, ((_, first, count), item_images) in enumerate(zip(items.tolist(), images)):
        for start, emb in item_images or ():
            lo, hi = max(start, first), min(start + len(emb), first + count)
            if lo < hi:
                rows.append(np.arange(at + lo - first, at + hi - first, dtype=np.int32))
                embd.append(emb[lo - start:hi - start])
        at += count + (len(drafts.get(i, ())) if drafts else 0)
    if not rows:
        return None
    rows_arr = np.concatenate(rows)
    tok[rows_arr] = 0
    return rows_arr, np.ascontiguousarray(np.concatenate(embd), dtype=np.float32)


def _select_rows(counts: list[int], rows: np.ndarray, hidden, all_logits) -> tuple[np.ndarray, np.ndarray]:
    """The step's logit rows and hidden rows (token indices in the flat batch; counts: each
    item's token count): an embedding item (hidden[i] set) has no logit rows and its
    wanted hidden rows, an all_logits item every one of its rows, the others their
    default row (rows) if they have one."""
    ends = np.cumsum(counts)
    starts = ends - np.asarray(counts)
    n = len(counts)
    is_embed = np.array([hidden is not None and hidden[i] is not None for i in range(n)])
    is_all = np.array([all_logits is not None and bool(all_logits[i]) for i in range(n)])
    keep = rows[~(is_embed | is_all)[np.searchsorted(ends, rows, side="right")]] if len(rows) else rows
    every = [np.arange(starts[i], ends[i]) for i in np.flatnonzero(is_all)]
    logit_rows = np.sort(np.concatenate([keep, *every])) if every else keep
    wanted = [np.arange(first, first + count) + starts[i]
              for i in np.flatnonzero(is_embed) for first, count in (hidden[i],) if count > 0]
    hidden_rows = np.concatenate(wanted) if wanted else np.empty(0)
    return np.ascontiguousarray(logit_rows, dtype=np.int32), np.ascontiguousarray(hidden_rows, dtype=np.int32)
