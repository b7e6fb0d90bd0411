"""A mapped GGUF's tensors described to a native object's set_tensor call, one by one (the
weights stay in the caller's mapping: the native side borrows them)."""

from __future__ import annotations

from typing import Callable

from .library import ffi


def attach_tensors(gguf, set_tensor: Callable, check: Callable[[int, str], None]) -> None:
    """set_tensor(name, type, ne, n_dims, data, n_bytes, used) for every tensor of gguf (a
    GGUFFile), each status through check(status, "tensor 'NAME'")."""
    ne = ffi.new("int64_t[4]")
    used = ffi.new("int32_t *")
    for t in gguf.tensors:
        for i, dim in enumerate(t.shape):
            ne[i] = dim
        data = ffi.from_buffer(gguf.tensor_bytes(t))
        check(set_tensor(t.name.encode(), t.type, ne, len(t.shape), data, t.n_bytes, used), f"tensor '{t.name}'")
