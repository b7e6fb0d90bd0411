"""A tiny BERT with random weights in Hugging Face's layout (config.json, vocab.txt,
model.safetensors, 1_Pooling/config.json), for converter, engine and server tests
that must not need the real all-MiniLM-L6-v2 package."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

WORDS = ("the cat sat on mat hello world dog run fast slow red blue green house tree river "
         "city night day light dark water fire stone play read write small big new old").split()
SPECIALS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCT = list(".,!?;:'\"()-$%&*/")
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
SUFFIXES = ["##s", "##ing", "##ed", "##er", "##ly"]


def tiny_vocab() -> list[str]:
    """[PAD] [unused0] [UNK] [CLS] [SEP] [MASK], punctuation, letters, ##letters, words, suffixes."""
    return SPECIALS + PUNCT + LETTERS + ["##" + c for c in LETTERS] + WORDS + SUFFIXES


def tiny_bert_weights(n_vocab: int, hidden: int = 64, layers: int = 2, ff: int = 128, max_pos: int = 64,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """BertModel tensors by their Hugging Face names, float32, random but well-scaled."""
    rng = np.random.default_rng(seed)

    def mat(rows, cols, std=0.15):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def vec(n, mean=0.0, std=0.05):
        return (mean + rng.standard_normal(n) * std).astype(np.float32)

    w = {"embeddings.word_embeddings.weight": mat(n_vocab, hidden, 0.5),
         "embeddings.token_type_embeddings.weight": mat(2, hidden, 0.5),
         "embeddings.position_embeddings.weight": mat(max_pos, hidden, 0.5),
         "embeddings.position_ids": np.arange(max_pos, dtype=np.int64)[None],   # not a weight: skipped
         "embeddings.LayerNorm.weight": vec(hidden, 1.0), "embeddings.LayerNorm.bias": vec(hidden),
         "pooler.dense.weight": mat(hidden, hidden), "pooler.dense.bias": vec(hidden)}   # unused by pooling
    for il in range(layers):
        p = f"encoder.layer.{il}."
        for name, rows, cols in (("attention.self.query", hidden, hidden), ("attention.self.key", hidden, hidden),
                                 ("attention.self.value", hidden, hidden), ("attention.output.dense", hidden, hidden),
                                 ("intermediate.dense", ff, hidden), ("output.dense", hidden, ff)):
            w[p + name + ".weight"] = mat(rows, cols)
            w[p + name + ".bias"] = vec(rows)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + norm + ".weight"] = vec(hidden, 1.0)
            w[p + norm + ".bias"] = vec(hidden)
    return w


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The .safetensors layout written by hand: an 8-byte header size, JSON, raw data."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    header, blobs, at = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_tiny_bert(folder: Path, pooling: str = "mean", **sizes) -> tuple[dict, dict]:
    """A model folder as sentence-transformers saves one; returns (weights, config)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tiny_vocab()
    weights = tiny_bert_weights(len(vocab), **sizes)
    hidden = weights["embeddings.LayerNorm.weight"].shape[0]
    config = {"model_type": "bert", "architectures": ["BertModel"], "hidden_act": "gelu",
              "hidden_size": hidden, "intermediate_size": weights["encoder.layer.0.intermediate.dense.weight"].shape[0],
              "num_hidden_layers": sum(1 for k in weights if k.endswith("attention.self.query.weight")),
              "num_attention_heads": 4, "layer_norm_eps": 1e-12, "type_vocab_size": 2,
              "max_position_embeddings": weights["embeddings.position_embeddings.weight"].shape[0],
              "vocab_size": len(vocab), "position_embedding_type": "absolute"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": pooling == "mean",
         "pooling_mode_cls_token": pooling == "cls"}))
    write_safetensors(folder / "model.safetensors", weights)
    return weights, config
