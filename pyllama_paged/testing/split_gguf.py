"""Write a GGUF as a split, the layout llama.cpp's gguf-split writes: PREFIX-00001-of-0000N.gguf
.. N, the first with the source's metadata and every part with split.no (0-based, u16),
split.count (u16) and split.tensors.count (i32, all parts together) and a run of the tensors,
their bytes copied as they are (nothing is decoded or re-quantized).

    python -P -m pyllama_paged.testing.split_gguf MODEL.gguf OUT_PREFIX --parts 3
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

from ..gguf.reader import GGUFFile, _Cursor, _read_header, _read_metadata
from ..gguf.split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, split_part_path

_ALIGN = 32   # GGUF's default alignment: the parts after the first carry no general.alignment
_U16, _I32, _STRING = 2, 5, 8


def _key(name: str, vtype: int, fmt: str, value) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype) + struct.pack(fmt, value)


def _split_keys(no: int, count: int, n_tensors: int) -> bytes:
    return (_key(SPLIT_NO, _U16, "<H", no) + _key(SPLIT_COUNT, _U16, "<H", count)
            + _key(SPLIT_TENSORS, _I32, "<i", n_tensors))


def _metadata_bytes(src: GGUFFile) -> tuple[bytes, int]:
    """The source's key/value section as it is in the file, and its key count."""
    cur = _Cursor(memoryview(src.data), src.path)
    _, _, n_kv = _read_header(cur)
    start = cur.pos
    _read_metadata(cur, n_kv)
    return bytes(src.data[start:cur.pos]), n_kv


def _write_part(path: str, version: int, kv: bytes, n_kv: int, tensors, src: GGUFFile, align: int) -> None:
    infos, offset, layout = bytearray(), 0, []
    for t in tensors:
        name = t.name.encode()
        infos += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
        infos += b"".join(struct.pack("<Q", d) for d in t.shape) + struct.pack("<IQ", t.type, offset)
        layout.append(offset)
        offset = -(-(offset + t.n_bytes) // align) * align
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), n_kv) + kv + bytes(infos)
    with open(path, "wb") as f:
        f.write(head + bytes(-len(head) % align))
        for t, at in zip(tensors, layout):
            f.seek(len(head) + (-len(head) % align) + at)
            f.write(memoryview(src.tensor_bytes(t)))
        f.truncate(len(head) + (-len(head) % align) + offset)


def write_split(src_path: str, prefix: str, n_parts: int) -> list[str]:
    """Split src_path into n_parts files PREFIX-0000k-of-0000N.gguf (tensors in file order, an
    even share each); returns their paths, the first part first."""
    src = GGUFFile(src_path)
    if not 1 <= n_parts <= len(src.tensors):
        raise ValueError(f"{n_parts} parts for {len(src.tensors)} tensors")
    kv, n_kv = _metadata_bytes(src)
    align = int(src.metadata.get("general.alignment", _ALIGN))
    n = len(src.tensors)
    bounds = [round(i * n / n_parts) for i in range(n_parts + 1)]
    paths = []
    for i in range(n_parts):
        path = split_part_path(prefix, i, n_parts)
        keys = _split_keys(i, n_parts, n)
        if i == 0:
            _write_part(path, src.version, kv + keys, n_kv + 3, src.tensors[bounds[0]:bounds[1]], src, align)
        else:
            _write_part(path, src.version, keys, 3, src.tensors[bounds[i]:bounds[i + 1]], src, _ALIGN)
        paths.append(path)
    src.close()
    return paths


def main() -> None:
    """The command line: split a GGUF into parts llama.cpp and pyllama-paged load."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("prefix", help="written as PREFIX-00001-of-0000N.gguf ...")
    parser.add_argument("--parts", type=int, default=2)
    args = parser.parse_args()
    for path in write_split(args.model, str(Path(args.prefix)), args.parts):
        print(path)


if __name__ == "__main__":
    main()
