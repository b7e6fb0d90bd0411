"""AttentionHarness: the attention operators alone on a KV pool, for kernel
tests and bench/kernels/attention.py."""

from __future__ import annotations

import numpy as np

from pyllama_paged._native import NativeHandle, check, ffi, lib
from pyllama_paged.engine import KV_TYPES


def _i32(a) -> tuple[np.ndarray, object]:
    arr = np.ascontiguousarray(a, dtype=np.int32)
    return arr, ffi.cast("int32_t *", ffi.from_buffer(arr))


def _f32(a) -> tuple[np.ndarray, object]:
    arr = np.ascontiguousarray(a, dtype=np.float32)
    return arr, ffi.cast("float *", ffi.from_buffer(arr))


class AttentionHarness(NativeHandle):
    """A KV pool of num_slots rows plus the paged and contiguous attention ops."""

    _destroy = staticmethod(lib.pp_attention_harness_destroy)

    def __init__(self, kv_cache_type: str, num_slots: int, n_head: int, n_head_kv: int,
                 head_dim: int, n_threads: int = 1):
        out = ffi.new("pp_attention_harness **")
        check(lib.pp_attention_harness_create(KV_TYPES[kv_cache_type], num_slots, n_head, n_head_kv,
                                              head_dim, n_threads, out), "AttentionHarness")
        self._handle = out[0]
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim

    @property
    def _h(self):
        """The native harness, for tests that call its C functions themselves."""
        return self._handle

    def write(self, slots, k: np.ndarray, v: np.ndarray) -> None:
        """Store f32 K/V rows [n, n_head_kv * head_dim] at slots."""
        s, sp = _i32(slots)
        k, kp = _f32(k)
        v, vp = _f32(v)
        check(lib.pp_attention_harness_write(self._handle, sp, len(s), kp, vp), "write")

    def read(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """K/V rows at slots as the kernel sees them (dequantized to f32)."""
        s, sp = _i32(slots)
        k = np.empty((len(s), self.n_head_kv * self.head_dim), np.float32)
        v = np.empty_like(k)
        check(lib.pp_attention_harness_read(self._handle, sp, len(s), _f32(k)[1], _f32(v)[1]), "read")
        return k, v

    def set_sinks(self, sinks) -> None:
        """Attention sinks (one logit per query head) for later calls; None: none."""
        if sinks is None:
            check(lib.pp_attention_harness_set_sinks(self._handle, ffi.NULL), "sinks")
            return
        s, sp = _f32(np.asarray(sinks, dtype=np.float32).reshape(self.n_head))
        check(lib.pp_attention_harness_set_sinks(self._handle, sp), "sinks")

    def paged(self, q: np.ndarray, positions, seq_index, block_tables, block_size: int,
              window: int = 0, scale: float | None = None) -> np.ndarray:
        """Paged attention; q [n_tokens, n_head, head_dim] -> out of the same shape."""
        q, qp = _f32(q)
        pos, pp = _i32(positions)
        seqs, sp = _i32(seq_index)
        tables, tp = _i32(block_tables)
        out = np.empty_like(q)
        b = ffi.new("pp_batch *")
        b.n_tokens = len(pos)
        b.positions = pp
        b.seq_index = sp
        b.n_seqs = tables.shape[0]
        b.block_tables = tp
        b.max_blocks_per_seq = tables.shape[1]
        scale = scale if scale is not None else self.head_dim ** -0.5
        check(lib.pp_attention_harness_paged(self._handle, b, block_size, window, scale, qp, _f32(out)[1]),
              "paged attention")
        return out

    def contiguous(self, q: np.ndarray, first_slot: int, n_kv: int, positions, window: int = 0,
                   scale: float | None = None) -> np.ndarray:
        """GGML flash attention over slots [first_slot, first_slot + n_kv)."""
        q, qp = _f32(q)
        pos, pp = _i32(positions)
        out = np.empty_like(q)
        scale = scale if scale is not None else self.head_dim ** -0.5
        check(lib.pp_attention_harness_contiguous(self._handle, first_slot, n_kv, len(pos), pp, window,
                                                  scale, qp, _f32(out)[1]), "contiguous attention")
        return out
