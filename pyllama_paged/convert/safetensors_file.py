"""A reader for .safetensors files (an 8-byte header length, a JSON header naming
each tensor's dtype, shape and byte range, then the raw little-endian data), so a
conversion needs neither torch nor the safetensors package."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as a NumPy array (BF16 widened to float32)."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (size,) = struct.unpack("<Q", data[:8])
    if 8 + size > len(data):
        raise ValueError(f"{path}: header of {size} bytes runs past the end of the file")
    header = json.loads(data[8:8 + size])
    body = memoryview(data)[8 + size:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= len(body):
            raise ValueError(f"{path}: tensor '{name}' lies outside the file")
        raw = np.frombuffer(body[start:end], dtype=np.uint16 if info["dtype"] == "BF16" else _DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":   # the high half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.reshape(info["shape"])
    return out
