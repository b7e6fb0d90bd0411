"""StepBuffers: the step's int32 arrays and the cdata pointers cast over them once per
allocation. What must hold: after a step that grows them the native struct and the cached
pointers point at the new arrays (a step reading the old ones would read freed memory), and
the cached items pointer is used only for the buffer's own rows."""

import numpy as np

from pyllama_paged._native import ffi
from pyllama_paged.engine.kv.step_batch import StepBuffers


def _address(cdata) -> int:
    return int(ffi.cast("intptr_t", cdata))


def _assert_pointers_follow_arrays(buffers: StepBuffers) -> None:
    tok, pos, slots, seqs, tables, rows = buffers.arrays(1, 1, 1)
    want = [a.ctypes.data for a in (tok, pos, slots, seqs, tables, rows)]
    assert [_address(p) for p in buffers.pointers] == want
    b = buffers.native
    assert [_address(p) for p in (b.token_ids, b.positions, b.slot_mapping, b.seq_index, b.block_tables,
                                  b.logit_rows)] == want


def test_growing_buffers_re_point_the_native_struct_and_the_cached_pointers():
    buffers = StepBuffers()
    buffers.reserve(1, 1, 4)
    _assert_pointers_follow_arrays(buffers)
    before = list(buffers.pointers)
    buffers.reserve(1, 1, 4)                  # no growth: the same casts
    assert buffers.pointers == tuple(before)
    buffers.reserve(600, 40, 64, n_groups=2)  # every array grows
    _assert_pointers_follow_arrays(buffers)
    assert all(_address(a) != _address(b) for a, b in zip(before, buffers.pointers))


def test_the_cached_items_pointer_is_only_for_the_buffers_own_rows():
    buffers = StepBuffers()
    buffers.reserve(8, 3, 4)
    own = buffers.items([(1, 0, 2), (2, 5, 1)])
    assert _address(buffers.item_pointer(own)) == own.ctypes.data
    foreign = np.array([[3, 0, 1]], dtype=np.int32)
    assert _address(buffers.item_pointer(foreign)) == foreign.ctypes.data
    buffers.reserve(8, 200, 4)                # the rows grow: the cast follows them
    own = buffers.items([(4, 0, 1)])
    assert _address(buffers.item_pointer(own)) == own.ctypes.data
