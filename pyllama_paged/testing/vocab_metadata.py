"""Writes a vocabulary as the tokenizer.ggml.* metadata of a GGUF being built, for the test
model writers (pyllama_paged/testing/reference/tiny_gguf.py, synthetic_gguf.py); and, for the
tests that build GGUFs by hand, metadata fields by their Python type and the file's last steps."""

from __future__ import annotations

from typing import Mapping

# vocabulary key -> GGUFWriter method; a key that is absent or None writes nothing
_IDS = (("bos", "add_bos_token_id"), ("eos", "add_eos_token_id"), ("unk", "add_unk_token_id"),
        ("pad", "add_pad_token_id"))
_FLAGS = (("add_bos", "add_add_bos_token"), ("add_eos", "add_add_eos_token"),
          ("add_space_prefix", "add_add_space_prefix"))


def add_tokenizer(w, model: str, pre: str, vocab: Mapping) -> None:
    """Add vocab's tokens and types, and whichever of scores, merges, special ids, flags and
    chat_template it holds, to the gguf.GGUFWriter w (in llama.cpp's converter's key order)."""
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab["tokens"])
    if vocab.get("scores") is not None:
        w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    if vocab.get("merges") is not None:
        w.add_token_merges(vocab["merges"])
    for key, method in _IDS:
        if vocab.get(key) is not None:
            getattr(w, method)(int(vocab[key]))
    for key, method in _FLAGS:
        if vocab.get(key) is not None:
            getattr(w, method)(bool(vocab[key]))
    if vocab.get("chat_template"):
        w.add_chat_template(vocab["chat_template"])


def add_fields(w, metadata: Mapping, integer: str = "add_uint32") -> None:
    """Add metadata to the gguf.GGUFWriter w by each value's type: the tokenizer's arrays (scores
    as FLOAT32, token types as INT32), bools, ints (with the writer's method named integer),
    strings."""
    for key, value in metadata.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            w.add_array(key, value)
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(v) for v in value])
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(v) for v in value])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            getattr(w, integer)(key, value)
        else:
            w.add_string(key, value)


def finish(w) -> None:
    """Write the gguf.GGUFWriter w's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
