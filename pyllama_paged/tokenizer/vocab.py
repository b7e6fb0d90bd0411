"""A tokenizer's vocabulary as GGUF metadata describes it (``tokenizer.ggml.*``): tokens,
scores, token types, merges, special ids and llama.cpp's flags, read and checked into a
plain ``Vocab``; and the end-of-generation tokens llama.cpp finds by their text.

``read_tokenizer_metadata`` accepts a path (read with the package's one, bounds-checked GGUF
reader, ``pyllama_paged.gguf.reader``), a ``gguf.GGUFReader``, an object with a ``metadata``
dict, or a ``{key: value}`` metadata dict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Mapping, Optional, Union

import numpy as np

from ..errors import ModelLoadError
from ..gguf.reader import read_metadata

__all__ = ["TokenType", "Vocab", "read_tokenizer_metadata", "vocab_from_metadata", "end_of_generation"]

MODELS = ("llama", "gpt2", "bert", "gemma4")


class TokenType(IntEnum):
    """Values of ``tokenizer.ggml.token_type``."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass
class Vocab:
    """What a tokenizer is built from; None means absent (the tokenizer takes llama.cpp's
    default for the model)."""

    tokens: list
    model: str
    scores: Optional[list[float]] = None
    token_types: Optional[list[int]] = None
    merges: Optional[list] = None
    pre: Optional[str] = None
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    unk_id: Optional[int] = None
    eot_id: Optional[int] = None
    eom_id: Optional[int] = None
    pad_id: Optional[int] = None
    add_bos: Optional[bool] = None
    add_eos: Optional[bool] = None
    add_space_prefix: Optional[bool] = None


def as_text(token: Union[str, bytes]) -> str:
    return token.decode("utf-8", "surrogateescape") if isinstance(token, bytes) else token


# --- reading the metadata ---------------------------------------------------------------------

_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _tokenizer_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


def _metadata_from_reader(reader) -> dict[str, Any]:
    """Tokenizer metadata from a ``gguf.GGUFReader``."""
    out = {}
    for key, field in reader.fields.items():
        if not _tokenizer_key(key):
            continue
        types = list(field.types)
        if types[0] == _GGUF_ARRAY:
            if len(types) > 1 and types[1] == _GGUF_STRING:
                out[key] = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            elif field.data:
                out[key] = np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])
            else:
                out[key] = np.zeros(0)
        elif types[0] == _GGUF_STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape")
        else:
            out[key] = field.parts[field.data[0]][0].item()
    return out


def read_tokenizer_metadata(source) -> Mapping[str, Any]:
    """The metadata of a GGUF path, a ``gguf.GGUFReader``, an object with a ``metadata`` dict
    (our ``GGUFFile``) or a metadata dict."""
    if isinstance(source, Mapping):
        return source
    if isinstance(getattr(source, "metadata", None), Mapping):
        return source.metadata
    if hasattr(source, "fields"):
        return _metadata_from_reader(source)
    # metadata only, strings lossless: vocabularies may hold bytes that are not UTF-8
    return read_metadata(os.fspath(source), errors="surrogateescape")


# --- checking each field ----------------------------------------------------------------------

def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string_list(md: Mapping[str, Any], key: str) -> Optional[list]:
    """A GGUF string array (a list of str/bytes), or None when absent."""
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, bytes)) for v in value):
        raise ModelLoadError(f"metadata field '{key}' must be an array of strings, got {_short(value)}")
    return list(value)


def _number_array(md: Mapping[str, Any], key: str, n: int, kinds: str) -> Optional[np.ndarray]:
    """A 1-D numeric array of n items (numpy dtype kind in kinds), or None when absent."""
    value = md.get(key)
    if value is None:
        return None
    arr = value if isinstance(value, np.ndarray) else None
    if arr is None and isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # ragged or mixed lists
            arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in kinds:
        what = "numbers" if "f" in kinds else "integers"
        raise ModelLoadError(f"metadata field '{key}' must be an array of {what}, got {_short(value)}")
    if len(arr) != n:
        raise ModelLoadError(f"metadata field '{key}' has {len(arr)} entries for {n} tokens")
    return arr


def _token_types(md: Mapping[str, Any], n: int) -> Optional[list[int]]:
    types = _number_array(md, "tokenizer.ggml.token_type", n, "biu")
    return None if types is None else types.tolist()


class _Fields:
    """The ``tokenizer.ggml.*`` scalars of one metadata dict, checked as they are read."""

    def __init__(self, md: Mapping[str, Any]):
        self.md = md

    def id(self, name: str, default: Optional[int] = None) -> Optional[int]:
        value = self.md.get(f"tokenizer.ggml.{name}")
        if value is None:
            return default
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ModelLoadError(f"metadata field 'tokenizer.ggml.{name}' must be an integer, "
                                 f"got {_short(value)}")
        return int(value)  # out of range: absent (the tokenizer drops it)

    def flag(self, name: str) -> Optional[bool]:
        value = self.md.get(f"tokenizer.ggml.{name}")
        if value is not None and not isinstance(value, (bool, int, np.bool_, np.integer)):
            raise ModelLoadError(f"metadata field 'tokenizer.ggml.{name}' must be a boolean, "
                                 f"got {_short(value)}")
        return None if value is None else bool(value)


def vocab_from_metadata(md: Mapping[str, Any]) -> Vocab:
    """The vocabulary GGUF metadata describes. A missing or mistyped field (e.g. scores that
    are strings, or fewer token types than tokens) raises ``ModelLoadError`` (a ``ValueError``)
    naming it."""
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.model")
    if not isinstance(model, str) or model not in MODELS:  # (an array has no `in`)
        raise ModelLoadError(f"tokenizer model {_short(model)} is not supported (only 'llama', 'gpt2', "
                             "'gemma4' and 'bert')")
    if "tokenizer.ggml.tokens" not in md:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
    tokens = _string_list(md, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("metadata field 'tokenizer.ggml.tokens' is empty")
    n = len(tokens)
    fields = _Fields(md)
    pre = md.get("tokenizer.ggml.pre")
    if pre is not None and not isinstance(pre, str):
        raise ModelLoadError(f"metadata field 'tokenizer.ggml.pre' must be a string, got {_short(pre)}")
    if model == "bert":
        return _bert_vocab(md, tokens, fields)
    spm = model == "llama"  # llama.cpp's defaults for SentencePiece vocabularies
    scores = _number_array(md, "tokenizer.ggml.scores", n, "biuf")
    return Vocab(
        tokens,
        model,
        scores=None if scores is None else scores.astype(np.float32).tolist(),
        token_types=_token_types(md, n),
        merges=_string_list(md, "tokenizer.ggml.merges"),
        pre=pre,
        bos_id=fields.id("bos_token_id", 1 if spm else None),
        eos_id=fields.id("eos_token_id", 2 if spm else None),
        unk_id=fields.id("unknown_token_id", 0 if spm else None),
        eot_id=fields.id("eot_token_id"),
        eom_id=fields.id("eom_token_id"),
        pad_id=fields.id("padding_token_id"),
        add_bos=fields.flag("add_bos_token"),
        add_eos=fields.flag("add_eos_token"),
        add_space_prefix=fields.flag("add_space_prefix"),
    )


def _bert_vocab(md: Mapping[str, Any], tokens: list, fields: _Fields) -> Vocab:
    """WordPiece: [CLS] is bos_token_id (llama.cpp's reading), [SEP] seperator_token_id (sic,
    llama.cpp's key) or eos_token_id; either found by its text when the file names neither."""
    token_types = _token_types(md, len(tokens))
    texts = {as_text(t): i for i, t in enumerate(tokens)}
    sep = fields.id("seperator_token_id", fields.id("eos_token_id", texts.get("[SEP]")))
    add_sep = fields.flag("add_sep_token")   # llama.cpp adds [SEP] unless this says not to
    return Vocab(tokens, "bert", token_types=token_types,
                 bos_id=fields.id("bos_token_id", texts.get("[CLS]")), eos_id=sep,
                 unk_id=fields.id("unknown_token_id", texts.get("[UNK]")), pad_id=fields.id("padding_token_id"),
                 add_bos=fields.flag("add_bos_token"), add_eos=True if add_sep is None else add_sep)


# --- end of generation ------------------------------------------------------------------------

# Token texts that llama.cpp treats as end of generation (and then as control tokens, so they
# are only parsed with parse_special) -- even "</s>", which Gemma 3 has as an HTML tag.
_END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# Harmony's message markup (gpt-oss), control tokens in its GGUF.
_HARMONY_HEADER_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# Of those, the ones that may serve as the EOT id when the GGUF names none.
_END_OF_TURN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)


def end_of_generation(vocab: Mapping[str, int], types: list[int], eos_id: Optional[int],
                      eot_id: Optional[int], eom_id: Optional[int]
                      ) -> tuple[Optional[int], Optional[int], frozenset]:
    """(eot_id, eom_id, the ids that end generation) the way llama.cpp finds them: the EOT and
    EOM ids by their text when the GGUF names none, and the known end-of-turn texts, which
    become control tokens in ``types`` (changed in place).

    Args:
        vocab: token text -> id.
    """
    if eot_id is None:
        eot_id = next((vocab[t] for t in _END_OF_TURN_TEXTS if t in vocab), None)
    if eom_id is None:
        eom_id = vocab.get("<|eom_id|>")
    found = {t: vocab[t] for t in _END_OF_GENERATION_TEXTS if t in vocab}
    for tid in found.values():
        types[tid] = int(TokenType.CONTROL)
    # llama.cpp's exceptions: with <|return|>+<|call|> (or <|calls|>+<|flush|>), <|end|> is
    # plain text; next to <|tool_response>, </s> is a normal token.
    continues = set()   # <|end|> ends a harmony message, not the reply, even as the EOT id
    if "<|end|>" in found and (("<|return|>" in found and "<|call|>" in found)
                               or ("<|calls|>" in found and "<|flush|>" in found)):
        end = found.pop("<|end|>")
        types[end] = int(TokenType.USER_DEFINED)
        continues.add(end)
    if "</s>" in found and "<|tool_response>" in found:
        types[found.pop("</s>")] = int(TokenType.NORMAL)
    # gpt-oss's harmony headers: llama.cpp makes them user-defined so that a reply's text keeps
    # them and its channels can be read
    for text in _HARMONY_HEADER_TEXTS:
        if text in vocab:
            types[vocab[text]] = int(TokenType.USER_DEFINED)
    eog = set(found.values())
    eog.update(t for t in (eos_id, eot_id, eom_id) if t is not None)
    return eot_id, eom_id, frozenset(eog - continues)
