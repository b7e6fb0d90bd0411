"""A fast, strict GGUF reader: metadata and tensor descriptions parsed from a
memory map, with errors that name the file and the field or tensor at fault.
(The `gguf` package's reader builds Python objects per array element, which
takes about a minute on a 262k-token vocabulary.)"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> (struct code, numpy dtype)
    0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
    4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
    10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64),
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # GGML order: shape[0] is the row length
    type: int                # ggml_type id
    offset: int              # absolute byte offset in the file
    n_bytes: int
    part: int = 0            # which file of a split GGUF holds it (gguf/split.py); 0 for a plain file


# GGML shapes and byte sizes are int64_t; a tensor has at most GGML_MAX_DIMS dims.
_INT64_MAX = 2**63 - 1
_MAX_DIMS = 4
# The fewest bytes a metadata field (key length, type, 1-byte value) and a tensor
# info (name length, n_dims, one dim, type, offset) take: a count is checked
# against the bytes left before anything is looped over or allocated for it.
_MIN_FIELD_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class _Cursor:
    def __init__(self, buf: memoryview, path: str, errors: str = "replace"):
        self.buf, self.pos, self.path, self.errors = buf, 0, path, errors

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated while reading {what} "
                                 f"(offset {self.pos}, file has {len(self.buf)} bytes)")

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items that take at least min_item_bytes each in the file."""
        n = self.unpack("Q", what)
        left = len(self.buf) - self.pos
        if n * min_item_bytes > left:
            raise ModelLoadError(f"{self.path}: {what} is {n}, but only {left} bytes follow: "
                                 "the file is truncated or corrupt")
        return n

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
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", self.errors)

    def _strings(self, count: int, what: str) -> list[str]:
        """count strings: string() unrolled, as a vocabulary holds ~10^5 of them."""
        buf, pos, end, errors = self.buf, self.pos, len(self.buf), self.errors
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end or pos + 8 + length(buf, pos)[0] > end:
                self.pos = pos
                self.string(what)  # raises the truncation error
            n = length(buf, pos)[0]
            raw = buf[pos + 8:pos + 8 + n]
            pos += 8 + n
            try:
                append(str(raw, "utf-8"))
            except UnicodeDecodeError:
                append(str(raw, "utf-8", errors))
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.unpack("I", what)
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                count = self.count(f"{what}: array length", dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr
            if etype == _STRING:
                return self._strings(self.count(f"{what}: array length", 8), what)
            raise ModelLoadError(f"{self.path}: {what}: unsupported array element type {etype}")
        raise ModelLoadError(f"{self.path}: {what}: unknown value type {vtype}")


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    """Magic and version checked; returns (version, n_tensors, n_kv)."""
    magic = bytes(cur.buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{cur.path}: not a GGUF file (magic {magic!r})")
    cur.pos = 4
    version = cur.unpack("I", "version")
    if version not in (2, 3):
        raise ModelLoadError(f"{cur.path}: GGUF version {version} unsupported (2 or 3)")
    n_tensors = cur.unpack("Q", "tensor count")
    n_kv = cur.count("the metadata field count", _MIN_FIELD_BYTES)
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> dict:
    metadata: dict = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:  # a second value would silently win; llama.cpp refuses too
            raise ModelLoadError(f"{cur.path}: metadata field '{key}' appears twice")
        vtype = cur.unpack("I", f"metadata field '{key}'")
        metadata[key] = cur.value(vtype, f"metadata field '{key}'")
    return metadata


def _map(path: str) -> np.memmap:
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: a directory, not a GGUF file")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file")
    if os.path.getsize(path) < 24:
        raise ModelLoadError(f"{path}: too small to be a GGUF file")
    return np.memmap(path, dtype=np.uint8, mode="r")


def read_metadata(path: str, errors: str = "replace") -> dict:
    """Only the key/value metadata of a GGUF file (tensor infos are not read).
    errors: how invalid UTF-8 in strings is decoded ("replace", "surrogateescape")."""
    path = str(path)
    cur = _Cursor(memoryview(_map(path)), path, errors)
    _, _, n_kv = _read_header(cur)
    return _read_metadata(cur, n_kv)


class GGUFFile:
    """Metadata, tensor table and a read-only map of one GGUF file."""

    def __init__(self, path: str):
        self.path = str(path)
        self.data = _map(self.path)
        cur = _Cursor(memoryview(self.data), self.path)
        self.version, n_tensors, n_kv = _read_header(cur)
        self.metadata = _read_metadata(cur, n_kv)
        left = len(self.data) - cur.pos
        if n_tensors * _MIN_TENSOR_INFO_BYTES > left:
            raise ModelLoadError(f"{self.path}: the tensor count is {n_tensors}, but only {left} bytes "
                                 "follow the metadata: the file is truncated or corrupt")
        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        alignment = _alignment(self.metadata, self.path)
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        seen: set[str] = set()
        for name, shape, ttype, offset in infos:
            if name in seen:
                raise ModelLoadError(f"{self.path}: tensor '{name}' appears twice")
            seen.add(name)
            if offset % alignment:
                raise ModelLoadError(f"{self.path}: tensor '{name}' has offset {offset}, not a multiple "
                                     f"of the file's alignment {alignment}")
            n_bytes = _tensor_bytes(self.path, name, shape, ttype)
            start = data_start + offset
            if start + n_bytes > len(self.data):
                raise ModelLoadError(
                    f"{self.path}: tensor '{name}' ends at byte {start + n_bytes}, past the end of "
                    f"the file ({len(self.data)} bytes): the file is truncated")
            self.tensors.append(TensorInfo(name, shape, ttype, start, n_bytes))

    def _read_tensor_info(self, cur: _Cursor, i: int) -> tuple:
        name = cur.string(f"tensor #{i} name")
        if "\0" in name:  # the native side takes C strings
            raise ModelLoadError(f"{self.path}: tensor #{i} name {name!r} contains a NUL byte")
        n_dims = cur.unpack("I", f"tensor '{name}'")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelLoadError(f"{self.path}: tensor '{name}' has {n_dims} dimensions "
                                 f"(GGML takes 1 to {_MAX_DIMS})")
        shape = tuple(cur.unpack("Q", f"tensor '{name}'") for _ in range(n_dims))
        ttype = cur.unpack("I", f"tensor '{name}'")
        offset = cur.unpack("Q", f"tensor '{name}'")
        return name, shape, ttype, offset

    @property
    def parts(self) -> list["GGUFFile"]:
        """The files holding the model: this one (a split GGUF has several: gguf/split.py)."""
        return [self]

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
    n = 1
    for d in shape:
        n *= d
    if max(shape, default=0) > _INT64_MAX or n > _INT64_MAX:
        raise ModelLoadError(f"{path}: tensor '{name}' shape {list(shape)} does not fit GGML's "
                             "64-bit sizes")
    if not shape or shape[0] % block:
        raise ModelLoadError(f"{path}: tensor '{name}' row of {shape[0] if shape else 0} is not "
                             f"whole {qtype.name} blocks of {block}")
    return n // block * type_size


def _alignment(metadata: dict, path: str) -> int:
    alignment = metadata.get("general.alignment", 32)
    if (isinstance(alignment, bool) or not isinstance(alignment, (int, np.integer))
            or alignment <= 0 or alignment & (alignment - 1)):
        raise ModelLoadError(f"{path}: metadata field 'general.alignment' must be a power of two, "
                             f"got {alignment!r}")
    return int(alignment)
