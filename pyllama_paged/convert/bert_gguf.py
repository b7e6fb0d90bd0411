"""Write a Hugging Face BERT checkpoint (a sentence-transformers model folder:
config.json, vocab.txt, model.safetensors, 1_Pooling/config.json) as a GGUF file
of architecture `bert`, with llama.cpp's tensor names and metadata keys, so that
the file also runs on llama.cpp and Ollama.

    python -m pyllama_paged.convert.bert_gguf MODEL_DIR OUT.gguf [--type f16|f32]

The vocabulary is written in llama.cpp's form: a word-initial piece carries a
leading "\u2581", a continuation piece ("##ing" in vocab.txt) is bare, bracketed
specials stay as they are.

A cross-encoder (a BertForSequenceClassification checkpoint: `classifier.weight`
beside the encoder) becomes a reranker in llama.cpp's layout: rank pooling
(`bert.pooling_type` 4), the pooler's dense layer as `cls.weight`/`cls.bias` and the
classifier as `cls.output.weight`/`cls.output.bias`, its labels as
`bert.classifier.output_labels`. llama.cpp's rank pooling applies `cls` then tanh,
then `cls.output`, to the [CLS] state: with the pooler kept, that is Hugging Face's
own score (llama.cpp's converter drops the pooler and maps the classifier alone).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
from pathlib import Path

import gguf
import numpy as np

from .safetensors_file import read_safetensors

_GLOBAL_NAMES = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
_LAYER_NAMES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_POOLING = {"pooling_mode_mean_tokens": gguf.PoolingType.MEAN, "pooling_mode_cls_token": gguf.PoolingType.CLS,
            "pooling_mode_lasttoken": gguf.PoolingType.LAST}


# BertForSequenceClassification's head, in llama.cpp's rank-pooling names
_HEAD_NAMES = {
    "pooler.dense.weight": "cls.weight",
    "pooler.dense.bias": "cls.bias",
    "classifier.weight": "cls.output.weight",
    "classifier.bias": "cls.output.bias",
}


def head_tensor_name(hf_name: str) -> str | None:
    """llama.cpp's name for a tensor of a cross-encoder's head, or None for any other."""
    return _HEAD_NAMES.get(hf_name.removeprefix("bert."))


def gguf_tensor_name(hf_name: str) -> str | None:
    """llama.cpp's name for a BertModel tensor, or None for one it does not use."""
    hf_name = hf_name.removeprefix("bert.")
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None   # position_ids, the pooler, a masked-LM head


def llama_cpp_token(piece: str) -> str:
    """A vocab.txt piece in llama.cpp's WordPiece spelling."""
    if piece.startswith("[") and piece.endswith("]"):
        return piece
    if piece.startswith("##"):
        return piece[2:]
    return "\u2581" + piece


def _pooling(model_dir: Path) -> gguf.PoolingType:
    config = model_dir / "1_Pooling" / "config.json"
    if not config.exists():
        return gguf.PoolingType.MEAN
    flags = json.loads(config.read_text())
    for key, kind in _POOLING.items():
        if flags.get(key):
            return kind
    raise ValueError(f"{config}: pooling {flags} has no GGUF equivalent (mean, cls or last)")


def _write_vocab(writer: gguf.GGUFWriter, model_dir: Path, type_vocab_size: int) -> None:
    pieces = (model_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    if pieces and pieces[-1] == "":
        pieces.pop()
    ids = {p: i for i, p in enumerate(pieces)}
    specials = {"[PAD]": "pad", "[UNK]": "unk", "[CLS]": "cls", "[SEP]": "sep", "[MASK]": "mask"}
    types = [gguf.TokenType.NORMAL] * len(pieces)
    for text in specials:
        if text in ids:
            types[ids[text]] = gguf.TokenType.UNKNOWN if text == "[UNK]" else gguf.TokenType.CONTROL
    writer.add_tokenizer_model("bert")
    writer.add_token_list([llama_cpp_token(p) for p in pieces])
    writer.add_token_types(types)
    writer.add_token_type_count(type_vocab_size)
    # llama.cpp reads CLS as the BOS token and adds it and SEP around every input
    for text, add in (("[CLS]", writer.add_bos_token_id), ("[SEP]", writer.add_sep_token_id),
                      ("[PAD]", writer.add_pad_token_id), ("[UNK]", writer.add_unk_token_id),
                      ("[MASK]", writer.add_mask_token_id)):
        if text in ids:
            add(ids[text])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)


def convert(model_dir: str | Path, out_path: str | Path, dtype: str = "f16", name: str | None = None) -> Path:
    """Write model_dir's BERT weights and vocabulary to out_path as a `bert` GGUF; returns out_path.
    dtype "f16" stores the matrices in half precision (norms and biases stay f32), "f32" all in f32."""
    model_dir, out_path = Path(model_dir), Path(out_path)
    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be 'f16' or 'f32', not {dtype!r}")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type", "bert") != "bert" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{model_dir}: only BERT with absolute positions converts (got "
                         f"{config.get('model_type')}, {config.get('position_embedding_type')})")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{model_dir}: hidden_act {config['hidden_act']!r}; the bert graph uses GELU")
    weights = read_safetensors(model_dir / "model.safetensors")
    # Written beside out_path under a temporary name, then renamed over it in one step: a
    # failure part way (a full disk, an interrupt) leaves an existing file as it was and
    # never a truncated GGUF that would only fail when loaded.
    tmp_path = _create_temp_beside(out_path)
    try:
        _write_gguf(tmp_path, model_dir, config, weights, dtype, name)
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())   # the bytes on disk before the name points at them
        os.replace(tmp_path, out_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return out_path


def _create_temp_beside(out_path: Path) -> Path:
    """A new empty file in out_path's folder (same file system, so the rename is atomic),
    created with the usual permissions (the umask applies, as it would to out_path)."""
    while True:
        tmp = out_path.with_name(f".{out_path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def _write_gguf(path: Path, model_dir: Path, config: dict, weights: dict, dtype: str, name: str | None) -> None:
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name(name or model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config.get("layer_norm_eps", 1e-12))
    writer.add_causal_attention(False)
    cross_encoder = "classifier.weight" in weights
    writer.add_pooling_type(gguf.PoolingType.RANK if cross_encoder else _pooling(model_dir))
    labels = config.get("id2label") or {}
    if cross_encoder and labels:
        writer.add_classifier_output_labels([labels[k] for k in sorted(labels, key=int)])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    _write_vocab(writer, model_dir, config.get("type_vocab_size", 2))
    for hf_name, array in weights.items():
        target = gguf_tensor_name(hf_name) or (head_tensor_name(hf_name) if cross_encoder else None)
        if target is None:
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        if dtype == "f16" and array.ndim == 2:
            array = array.astype(np.float16)
        writer.add_tensor(target, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> None:
    """Command line: MODEL_DIR OUT.gguf [--type f16|f32] [--name NAME]."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--type", default="f16", choices=["f16", "f32"])
    parser.add_argument("--name")
    args = parser.parse_args(argv)
    print(convert(args.model_dir, args.out, args.type, args.name))


if __name__ == "__main__":
    main()
