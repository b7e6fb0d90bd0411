"""A tiny BERT with random weights in Hugging Face's layout (config.json, vocab.txt,
model.safetensors, 1_Pooling/config.json), for converter, engine and server tests
that must not need the real all-MiniLM-L6-v2 package; and a tiny cross-encoder (a
BertForSequenceClassification checkpoint: the encoder under `bert.`, its pooler and a
classifier) for the reranking tests."""

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


def _config(weights: dict, n_vocab: int, architecture: str) -> dict:
    hidden = weights["embeddings.LayerNorm.weight"].shape[0]
    return {"model_type": "bert", "architectures": [architecture], "hidden_act": "gelu",
            "hidden_size": hidden, "intermediate_size": weights["encoder.layer.0.intermediate.dense.weight"].shape[0],
            "num_hidden_layers": sum(1 for k in weights if k.endswith("attention.self.query.weight")),
            "num_attention_heads": 4, "layer_norm_eps": 1e-12, "type_vocab_size": 2,
            "max_position_embeddings": weights["embeddings.position_embeddings.weight"].shape[0],
            "vocab_size": n_vocab, "position_embedding_type": "absolute"}


def _write_folder(folder: Path, config: dict, vocab: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")


def write_tiny_bert(folder: Path, pooling: str = "mean", **sizes) -> tuple[dict, dict]:
    """A model folder as sentence-transformers saves one; returns (weights, config)."""
    vocab = tiny_vocab()
    weights = tiny_bert_weights(len(vocab), **sizes)
    hidden = weights["embeddings.LayerNorm.weight"].shape[0]
    config = _config(weights, len(vocab), "BertModel")
    _write_folder(folder, config, vocab)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": pooling == "mean",
         "pooling_mode_cls_token": pooling == "cls"}))
    write_safetensors(folder / "model.safetensors", weights)
    return weights, config


def write_tiny_cross_encoder(folder: Path, n_labels: int = 1, seed: int = 1, **sizes) -> tuple[dict, dict]:
    """A BertForSequenceClassification folder as Hugging Face saves one (no pooling config;
    the pooler's dense layer and the classifier after it are the head); returns (weights by
    their checkpoint names, config)."""
    vocab = tiny_vocab()
    encoder = tiny_bert_weights(len(vocab), seed=seed, **sizes)
    hidden = encoder["embeddings.LayerNorm.weight"].shape[0]
    rng = np.random.default_rng(seed + 1000)
    weights = {f"bert.{name}": array for name, array in encoder.items()}
    weights["classifier.weight"] = (rng.standard_normal((n_labels, hidden)) * 0.5).astype(np.float32)
    weights["classifier.bias"] = (rng.standard_normal(n_labels) * 0.1).astype(np.float32)
    config = _config(encoder, len(vocab), "BertForSequenceClassification")
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(n_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(n_labels)}
    _write_folder(folder, config, vocab)
    write_safetensors(folder / "model.safetensors", weights)
    return weights, config


def converted(root: Path, write=write_tiny_bert, stem: str = "tiny-bert") -> tuple[dict, dict, dict[str, str]]:
    """A tiny checkpoint written by write(root / "hf") and converted by our tool to f32 and
    f16 GGUFs: (weights, config, {dtype: path})."""
    from ...convert.bert_gguf import convert

    weights, config = write(root / "hf")
    paths = {dtype: str(convert(root / "hf", root / f"{stem}-{dtype}.gguf", dtype)) for dtype in ("f32", "f16")}
    return weights, config, paths
