"""Model files the benchmarks make from the default model: its unquantized twin (F16, BF16) or a
Q4_0 requantization, cached in bench/.models/ (ignored by git).

An export is every quantized tensor dequantized to F16 (or BF16; or, for the Q4_0 kernels'
benchmark, requantized to Q4_0 throughout, as llama-quantize --pure would), the F32 tensors (the
norms) kept as they are, every metadata key copied except the file type (the header's own keys,
GGUF.*, the writer writes again). Its tokenizer is the source's to the token, so the source can
draft for it: the default model's F16 export is the target of bench/engine/speculative.py's
draft-model mode, with the Q4_K_M file it was made from as the draft.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np

from bench.common.report import BENCH_DIR

MODELS_DIR = BENCH_DIR / ".models"
FILE_TYPES = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
KEPT = (gguf.GGMLQuantizationType.F32,)
# written by GGUFWriter itself (its header and architecture), or no longer true of the export
SKIPPED_KEYS = ("general.architecture", "general.file_type", "general.quantization_version")


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in SKIPPED_KEYS:
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        if sub == gguf.GGUFValueType.ARRAY:
            raise ValueError(f"metadata key {key}: nested arrays are not copied")
        writer.add_key_value(key, field.contents(), main, sub_type=sub)


def _converted(tensor, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(array for GGUFWriter.add_tensor, its raw type or None): F32 as it is, F16 as it
    is for an f16 export, anything else dequantized and stored in dtype."""
    qtype = tensor.tensor_type
    if qtype in KEPT or (dtype == "f16" and qtype == gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data), None
    values = gguf.quants.dequantize(tensor.data, qtype)
    if dtype == "f16" or (dtype == "q4_0" and (values.ndim != 2 or values.shape[-1] % 32)):
        return values.astype(np.float16), None
    raw = gguf.GGMLQuantizationType.Q4_0 if dtype == "q4_0" else gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(values, raw), raw


def export(source: str | Path, out: str | Path, dtype: str = "f16") -> Path:
    """Write source's dequantized twin to out (through a temporary file beside it, so an
    interrupted export never leaves a file that looks finished); returns out."""
    if dtype not in FILE_TYPES:
        raise ValueError(f"dtype must be one of {', '.join(FILE_TYPES)}, not {dtype!r}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    try:
        _copy_metadata(reader, writer)
        writer.add_file_type(int(FILE_TYPES[dtype]))
        for tensor in reader.tensors:
            array, raw = _converted(tensor, dtype)
            writer.add_tensor(tensor.name, array, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return out


def default_export(dtype: str = "f16") -> Path:
    """The embedded default model's export in bench/.models/, written the first time."""
    from pyllama_paged.engine import default_model_path

    source = Path(default_model_path())
    out = MODELS_DIR / f"{source.stem.removesuffix('-q4_k_m')}-{dtype}.gguf"
    if not out.exists():
        print(f"exporting {source} to {out} ...", file=sys.stderr)
        export(source, out, dtype)
    return out
