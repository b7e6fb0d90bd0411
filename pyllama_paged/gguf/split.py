"""Split GGUF files as llama.cpp's gguf-split writes them: NAME-00001-of-0000N.gguf .. N, each a
GGUF of its own; the first holds the model's metadata, every part the keys split.no (0-based),
split.count and split.tensors.count (the tensors of all parts together), and its share of the
tensors. open_gguf reads one file or all parts of a split as one GGUF."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ModelLoadError
from .reader import GGUFFile, TensorInfo

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_path(prefix: str, index: int, count: int) -> str:
    """The file of part index (0-based) of count: llama.cpp's PREFIX-%05d-of-%05d.gguf."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def split_prefix(path: str) -> tuple[str, int, int] | None:
    """(prefix, 0-based part, count) of a part's file name, or None for any other name."""
    m = _PART_NAME.match(str(path))
    if m is None:
        return None
    return m["prefix"], int(m["no"]) - 1, int(m["count"])


def _int_key(gguf: GGUFFile, key: str) -> int | None:
    value = gguf.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{gguf.path}: metadata field '{key}' must be an integer, got {value!r}")
    return value


def open_gguf(path: str) -> GGUFFile | SplitGGUF:
    """The GGUF at path: a plain file, or (split.count > 1) every part of its split, read from
    the first part's name; ModelLoadError names a missing part, a part of another split, a
    count that does not match, or a path that is not the first part."""
    first = GGUFFile(path)
    count = _int_key(first, SPLIT_COUNT)
    if count is None or count <= 1:
        return first
    try:
        return SplitGGUF(first, count)
    except BaseException:
        first.close()
        raise


class SplitGGUF:
    """The parts of a split GGUF read as one: the first part's metadata, every part's tensors
    (each TensorInfo's part says whose map its offset is in)."""

    def __init__(self, first: GGUFFile, count: int):
        self.path = first.path
        self.version = first.version
        self.metadata = first.metadata
        self.parts: list[GGUFFile] = [first]
        no = _int_key(first, SPLIT_NO)
        named = split_prefix(self.path)
        if no != 0 or named is None or named[1] != 0 or named[2] != count:
            where = f"part {no + 1} of {count}" if no is not None else f"a part of a {count}-part split"
            raise ModelLoadError(f"{self.path}: {where} of a split GGUF; load its first part, named "
                                 f"PREFIX-00001-of-{count:05d}.gguf, beside the others")
        prefix = named[0]
        try:
            for i in range(1, count):
                self.parts.append(self._open_part(split_part_path(prefix, i, count), i, count))
        except BaseException:
            self.close()
            raise
        self.tensors = self._gather_tensors(_int_key(first, SPLIT_TENSORS))

    def _open_part(self, part_path: str, index: int, count: int) -> GGUFFile:
        if not Path(part_path).is_file():
            raise ModelLoadError(f"{self.path}: part {index + 1} of {count} of this split GGUF is missing "
                                 f"({part_path})")
        part = GGUFFile(part_path)
        no, n = _int_key(part, SPLIT_NO), _int_key(part, SPLIT_COUNT)
        if n != count or no != index:
            part.close()
            raise ModelLoadError(f"{part_path}: says it is part {'?' if no is None else no + 1} of "
                                 f"{n or '?'}, but it is named part {index + 1} of {count} (a part of "
                                 "another split?)")
        return part

    def _gather_tensors(self, expected: int | None) -> list[TensorInfo]:
        tensors: list[TensorInfo] = []
        seen: set[str] = set()
        for i, part in enumerate(self.parts):
            for t in part.tensors:
                if t.name in seen:
                    raise ModelLoadError(f"{part.path}: tensor '{t.name}' is in two parts of the split")
                seen.add(t.name)
                tensors.append(TensorInfo(t.name, t.shape, t.type, t.offset, t.n_bytes, i))
        if expected is not None and expected != len(tensors):
            raise ModelLoadError(f"{self.path}: split.tensors.count says {expected} tensors, but the "
                                 f"{len(self.parts)} parts hold {len(tensors)}")
        return tensors

    @property
    def data(self):
        """The first part's map (its header: metadata and its tensor table)."""
        return self.parts[0].data

    def tensor_bytes(self, info: TensorInfo):
        """The tensor's raw bytes (a view of its part's map, no copy)."""
        data = self.parts[info.part].data
        return data[info.offset:info.offset + info.n_bytes]

    def close(self) -> None:
        for part in self.parts:
            part.close()
