"""A fast, strict GGUF reader: metadata and tensor descriptions parsed from a
memory map, with errors that name the file and the field or tensor at fault.
(The `gguf` package's reader builds Python objects per array element, which
takes about a minute on a 262k-token vocabulary.)"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from .config import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> (struct code, numpy dtype)
    0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
    4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
    10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # GGML order: shape[0] is the row length
    type: int                # ggml_type id
    offset: int              # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated while reading {what} "
                                 f"(offset {self.pos}, file has {len(self.buf)} bytes)")

    def unpack(self, code: str, what: str):
        size = struct.calcsize("<" + code)
        self.need(size, what)
        value = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # Lossless: vocabularies may hold byte strings that are not UTF-8.
        return raw.decode("utf-8", "surrogateescape")

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.unpack("I", what)
            count = self.unpack("Q", what)
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                self.need(count * dtype.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr
            if etype == _STRING:
                return [self.string(what) for _ in range(count)]
            raise ModelLoadError(f"{self.path}: {what}: unsupported array element type {etype}")
        raise ModelLoadError(f"{self.path}: {what}: unknown value type {vtype}")


class GGUFFile:
    """Metadata, tensor table and a read-only map of one GGUF file."""

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ModelLoadError(f"{self.path}: no such file")
        if os.path.getsize(self.path) < 24:
            raise ModelLoadError(f"{self.path}: too small to be a GGUF file")
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self.data), self.path)
        magic = bytes(self.data[:4])
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic {magic!r})")
        cur.pos = 4
        self.version = cur.unpack("I", "version")
        if self.version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {self.version} unsupported (2 or 3)")
        n_tensors = cur.unpack("Q", "tensor count")
        n_kv = cur.unpack("Q", "metadata count")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelLoadError(f"{self.path}: implausible header ({n_tensors} tensors, {n_kv} fields)")
        self.metadata: dict = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.unpack("I", f"metadata field '{key}'")
            self.metadata[key] = cur.value(vtype, f"metadata field '{key}'")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor #{i} name")
            n_dims = cur.unpack("I", f"tensor '{name}'")
            if n_dims > 4:
                raise ModelLoadError(f"{self.path}: tensor '{name}' has {n_dims} dimensions (max 4)")
            shape = tuple(cur.unpack("Q", f"tensor '{name}'") for _ in range(n_dims))
            ttype = cur.unpack("I", f"tensor '{name}'")
            offset = cur.unpack("Q", f"tensor '{name}'")
            infos.append((name, shape, ttype, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, shape, ttype, offset in infos:
            n_bytes = _tensor_bytes(self.path, name, shape, ttype)
            start = data_start + offset
            if start + n_bytes > len(self.data):
                raise ModelLoadError(
                    f"{self.path}: tensor '{name}' ends at byte {start + n_bytes}, past the end of "
                    f"the file ({len(self.data)} bytes): the file is truncated")
            self.tensors.append(TensorInfo(name, shape, ttype, start, n_bytes))

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes (a view of the map, no copy)."""
        return self.data[info.offset:info.offset + info.n_bytes]

    def close(self) -> None:
        self.data = None


def _tensor_bytes(path: str, name: str, shape: tuple[int, ...], ttype: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ttype)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelLoadError(f"{path}: tensor '{name}' has unknown ggml type {ttype}") from None
    if not shape or shape[0] % block:
        raise ModelLoadError(f"{path}: tensor '{name}' row of {shape[0] if shape else 0} is not "
                             f"whole {qtype.name} blocks of {block}")
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size
