"""ModelRunner: the KV pools and compute context of one model; runs a batched
forward step given flat token / position / slot / block-table arrays."""

from __future__ import annotations

import numpy as np

from ._native import check, ffi, lib
from .errors import PagedError

KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml_type ids


def _ptr(arr: np.ndarray, ctype: str = "int32_t *"):
    return ffi.cast(ctype, ffi.from_buffer(arr))


class ModelRunner:
    """Owns the KV cache and compute context for one model."""

    def __init__(self, model, *, kv_cache_type: str = "f16", num_blocks: int,
                 block_size: int, paged: bool = True, n_threads: int = 1,
                 max_batch_tokens: int = 512):
        if kv_cache_type not in KV_TYPES:
            raise PagedError(f"kv_cache_type '{kv_cache_type}' unsupported: choose one of "
                             f"{', '.join(KV_TYPES)}")
        self.model = model
        self.paged = paged
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache_type = kv_cache_type
        self.n_vocab = model.config.n_vocab
        self.max_batch_tokens = max_batch_tokens
        self._cache = None
        self._ctx = None
        out = ffi.new("pp_kv_cache **")
        check(lib.pp_kv_cache_create(model.native, KV_TYPES[kv_cache_type], num_blocks,
                                     block_size, int(paged), out), "KV cache")
        self._cache = out[0]
        ctx = ffi.new("pp_context **")
        check(lib.pp_context_create(model.native, self._cache, n_threads, max_batch_tokens, ctx),
              "context")
        self._ctx = ctx[0]
        self._batch = ffi.new("pp_batch *")

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes one token takes across all layers."""
        return lib.pp_kv_cache_bytes_per_token(self._cache)

    def abort(self) -> None:
        """Stop the running step (or the next one) from any thread: it raises ComputeError."""
        check(lib.pp_context_abort(self._ctx), "abort")

    def set_threads(self, n_threads: int) -> None:
        check(lib.pp_context_set_threads(self._ctx, n_threads), "set_threads")

    def forward(self, token_ids, positions, slot_mapping, seq_index, block_tables,
                logit_rows) -> np.ndarray:
        """One step; returns logits [len(logit_rows), n_vocab] as float32."""
        arrays = [np.ascontiguousarray(a, dtype=np.int32) for a in
                  (token_ids, positions, slot_mapping, seq_index, logit_rows)]
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        if tables.ndim != 2:
            raise PagedError("block_tables must be 2-D [n_seqs, max_blocks]")
        tok, pos, slots, seqs, rows = arrays
        n = len(tok)
        if not (len(pos) == len(slots) == len(seqs) == n):
            raise PagedError("token_ids, positions, slot_mapping and seq_index differ in length")
        logits = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        b = self._batch
        b.n_tokens = n
        b.token_ids = _ptr(tok)
        b.positions = _ptr(pos)
        b.slot_mapping = _ptr(slots)
        b.seq_index = _ptr(seqs)
        b.n_seqs = tables.shape[0]
        b.block_tables = _ptr(tables)
        b.max_blocks_per_seq = tables.shape[1]
        b.n_logits = len(rows)
        b.logit_rows = _ptr(rows) if len(rows) else ffi.NULL
        check(lib.pp_context_decode(self._ctx, b, _ptr(logits, "float *")), "forward")
        return logits

    def copy_blocks(self, copies) -> None:
        """Perform copy-on-write block copies [(src, dst), ...] in the KV pools."""
        if not copies:
            return
        arr = ffi.new("pp_block_copy[]", [{"src": s, "dst": d} for s, d in copies])
        check(lib.pp_kv_cache_copy_blocks(self._cache, arr, len(copies)), "copy_blocks")

    @property
    def block_bytes(self) -> int:
        """Host bytes one block's K and V take across all layers."""
        return self.kv_bytes_per_token * self.block_size

    def read_block(self, block_id: int) -> np.ndarray:
        """A host copy of one block's K and V (all layers): the swap-out copy."""
        out = np.empty(self.block_bytes, dtype=np.uint8)
        check(lib.pp_kv_cache_read_block(self._cache, block_id, ffi.from_buffer(out)), "read_block")
        return out

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        """Restore one block's K and V from a host copy (swap-in)."""
        check(lib.pp_kv_cache_write_block(self._cache, block_id, ffi.from_buffer(data)), "write_block")

    def close(self) -> None:
        """Free the context and the KV pools."""
        if self._ctx is not None:
            lib.pp_context_destroy(self._ctx)
            self._ctx = None
        if self._cache is not None:
            lib.pp_kv_cache_destroy(self._cache)
            self._cache = None

    def __del__(self):
        self.close()
