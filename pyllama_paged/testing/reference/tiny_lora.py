"""Tiny LoRA adapters for tests, written as llama.cpp's convert_lora_to_gguf.py writes them
(general.type = adapter, adapter.type = lora, adapter.lora.alpha, and for each adapted
projection "<base tensor>.lora_a" [in, rank] and ".lora_b" [rank, out] in GGML order), and
the float64 reference of a model running one: W + scale * alpha / rank * B A merged into a
copy of the ReferenceModel's weights (llama.cpp's adapter scale; alpha 0 reads as scale alone).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import gguf
import numpy as np

from .numpy_model import ReferenceModel, load_tensor, read_gguf

# the projections a converted PEFT adapter usually targets (q_proj, k_proj, v_proj, o_proj,
# gate_proj, up_proj, down_proj)
ALL_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_tiny_lora(path: str | os.PathLike, base_path: str | os.PathLike, *, rank: int = 4,
                    alpha: float | None = 8.0, targets: Sequence[str] = ALL_TARGETS,
                    layers: Sequence[int] | None = None, seed: int = 0, std: float = 0.5,
                    dtype: str = "f32", extra_metadata: dict[str, str] | None = None) -> str:
    """An adapter of base_path's model: random A and B (B not zero, as a trained adapter's)
    for each target of each layer (all layers if None); alpha None leaves the key out; dtype
    "f32" or "f16" (the converter's --outtype). Returns the path."""
    meta, infos, _ = read_gguf(base_path)
    arch = meta["general.architecture"]
    shapes = {info.name: info.ne for info in infos}
    n_layer = int(meta[f"{arch}.block_count"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for key, value in (extra_metadata or {}).items():
        w.add_string(key, value)
    np_type = np.float16 if dtype == "f16" else np.float32
    for il in (range(n_layer) if layers is None else layers):
        for target in targets:
            name = f"blk.{il}.{target}.weight"
            n_in, n_out = shapes[name][0], shapes[name][1]
            a = rng.normal(0.0, 1.0 / np.sqrt(n_in), size=(rank, n_in))       # numpy [rank, in]
            b = rng.normal(0.0, std / np.sqrt(rank), size=(n_out, rank))      # numpy [out, rank]
            w.add_tensor(name + ".lora_a", a.astype(np_type))
            w.add_tensor(name + ".lora_b", b.astype(np_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def with_lora(ref: ReferenceModel, adapter_path: str | os.PathLike, scale: float = 1.0) -> ReferenceModel:
    """A copy of ref whose adapted weights are W + scale * alpha / rank * B A, in float64."""
    meta, infos, mm = read_gguf(adapter_path)
    alpha = float(meta.get(gguf.Keys.Adapter.LORA_ALPHA, 0.0))
    loaded = {info.name: load_tensor(mm, info).astype(np.float64) for info in infos}
    tensors = dict(ref.tensors)
    for name, a in loaded.items():
        if not name.endswith(".lora_a"):
            continue
        base = name[: -len(".lora_a")]
        b = loaded[base + ".lora_b"]
        rank = a.shape[0]
        factor = alpha / rank if alpha != 0.0 else 1.0
        tensors[base] = ref.tensors[base].astype(np.float64) + scale * factor * (b @ a)
    return dataclasses.replace(ref, tensors=tensors, _head64=None)
