"""Byte-level BPE encoding (GPT-2 style), as llama.cpp does it for ``tokenizer.ggml.model = "gpt2"``.

1. A pre-tokenizer (one or more regexes chosen by ``tokenizer.ggml.pre``) cuts the text into
   words; text between matches is kept as words too, and each later regex only cuts the
   pieces the previous one produced.
2. Each word's UTF-8 bytes are written as GPT-2 "byte characters" (every byte maps to one
   printable character, e.g. space -> "Ġ").
3. If the vocabulary says so (``ignore_merges``, Llama 3), a word that is a vocabulary entry
   is one token. Otherwise adjacent symbols are merged by merge rank (lowest first, leftmost
   first on ties), and each final piece is looked up.

The regexes use Unicode classes (``\\p{L}``, ``\\p{N}``, ``\\p{P}``) that Python's ``re`` lacks,
so, like llama.cpp, we first write a "category text": ASCII characters stay as they are and
every other character becomes one stand-in character for its class (letter, number, white
space, punctuation, other). The regexes run on that text (same length), and the spans they
find cut the original text.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from typing import Iterable, Optional

from .spm import WordCache, bigram_merge, encode_words



def _make_byte_chars() -> list[str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    others (controls, space, DEL, NBSP, soft hyphen...) take the characters from U+0100 on."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = [], 0
    for byte in range(256):
        if byte in keep:
            table.append(chr(byte))
        else:
            table.append(chr(0x100 + extra))
            extra += 1
    return table


BYTE_TO_CHAR: list[str] = _make_byte_chars()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# bytes.decode("latin-1") gives chr(byte); this table then maps each to its byte character.
_BYTE_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def bytes_to_bpe_text(data: bytes) -> str:
    return data.decode("latin-1").translate(_BYTE_ENCODE_TABLE)


def bpe_text_to_bytes(text: str) -> bytes:
    """Inverse of ``bytes_to_bpe_text``; characters outside the table keep their UTF-8 bytes."""
    out = bytearray()
    for ch in text:
        byte = CHAR_TO_BYTE.get(ch)
        if byte is None:
            out += ch.encode("utf-8", "surrogateescape")
        else:
            out.append(byte)
    return bytes(out)


# --- character classes ------------------------------------------------------------------------

# Stand-ins for non-ASCII characters in the category text (marks apart from the other
# characters: Qwen3.5's words take them in; for the other regexes they are "other" as before).
_LETTER, _NUMBER, _SPACE, _PUNCT, _OTHER, _MARK = "\u0100", "\u0101", "\u0102", "\u0103", "\u0104", "\u0105"
# Unicode White_Space characters outside ASCII.
_WIDE_SPACES = {0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000, *range(0x2000, 0x200B)}


class _CategoryTable(dict):
    """``str.translate`` table: ASCII maps to itself, anything else to its class stand-in."""

    def __missing__(self, cp: int) -> str:
        if cp < 0x80:
            value = chr(cp)
        elif cp in _WIDE_SPACES:
            value = _SPACE
        else:
            major = unicodedata.category(chr(cp))[0]
            value = {"L": _LETTER, "N": _NUMBER, "P": _PUNCT, "M": _MARK}.get(major, _OTHER)
        self[cp] = value
        return value


_CATEGORY_TABLE = _CategoryTable()

_ASCII_PUNCT = "".join(chr(c) for c in range(0x80) if unicodedata.category(chr(c)).startswith("P"))
# Contents of a regex character class, per Unicode class (on the category text).
_CLASS = {
    "L": "A-Za-z" + _LETTER,
    "N": "0-9" + _NUMBER,
    "S": "\\t\\n\\x0b\\x0c\\r " + _SPACE,
    "P": re.escape(_ASCII_PUNCT) + _PUNCT,
    "M": _MARK,   # no ASCII character is a mark
}


def _rx(pattern: str) -> "re.Pattern[str]":
    """Compile a pattern written with {L} {N} {S} {P} placeholders for class contents."""
    return re.compile(pattern.format(**_CLASS))


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^{S}{L}{N}]+[\r\n]*"
           r"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n{L}{N}]?[{L}]+|[{N}]| ?[^{S}{L}{N}]+[\r\n]*"
          r"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")
# Qwen3.5/3.6 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35): Qwen 2.5's, but a word's letters take
# combining marks along ([\p{L}\p{M}]+) and a symbol run stops at one
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n{L}{N}]?[{L}{M}]+|[{N}]| ?[^{S}{L}{M}{N}]+[\r\n]*"
           r"|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")
# OpenAI's o200k (GPT-4o, gpt-oss): a word is a run of upper-case letters then lower-case
# ones (or the other way round), with an optional leading symbol and a trailing contraction;
# numbers in groups of up to three; a symbol run takes the newlines and slashes after it.
# Like llama.cpp, a non-ASCII letter counts as both cases (the category text keeps one class
# of letters), so only ASCII letters change case inside a word.
_UPPER, _LOWER = "A-Z" + _LETTER, "a-z" + _LETTER
_O200K = (rf"[^\r\n{{L}}{{N}}]?[{_UPPER}]*[{_LOWER}]+{_CONTRACTIONS}?"
          rf"|[^\r\n{{L}}{{N}}]?[{_UPPER}]+[{_LOWER}]*{_CONTRACTIONS}?"
          r"|[{N}]{{1,3}}| ?[^{S}{L}{N}]+[\r\n/]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+")

# tokenizer.ggml.pre -> regexes applied in turn, and extra flags llama.cpp sets for that family.
_PRE_FAMILIES = {
    "llama3": ([_LLAMA3], {"ignore_merges": True, "add_bos": True}),
    "qwen2": ([_QWEN2], {}),
    "qwen35": ([_QWEN35], {}),
    "gpt-4o": ([_O200K], {}),
    "gpt2": ([_GPT2], {}),
    "smollm": ([r"[{N}]", _GPT2], {}),
    "falcon": ([r"[{P}$+<=>^~|`]+", _GPT2, r"[0-9][0-9][0-9]"], {}),
    "default": ([r"[{P}$+<=>^~|]+", _GPT2, r"[{N}]+", r"[0-9][0-9][0-9]"], {}),
}
_PRE_ALIASES = {
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "falcon-h1": "llama3", "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "qwen35": "qwen35",
    "gpt-2": "gpt2", "gpt2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "jina-es": "gpt2", "jina-de": "gpt2", "jina-v2-es": "gpt2", "jina-v2-de": "gpt2",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "command-r": "smollm",
    "codeshell": "smollm", "exaone": "smollm", "minerva-7b": "smollm",
    "falcon": "falcon",
    "gpt-4o": "gpt-4o", "llama4": "gpt-4o", "kanana2": "gpt-4o", "talkie": "gpt-4o",
    "default": "default", "": "default",
}


def pre_tokenizer_family(pre: Optional[str]) -> str:
    family = _PRE_ALIASES.get(pre or "")
    if family is None:
        warnings.warn(f"unknown BPE pre-tokenizer {pre!r}; using the 'default' regexes", stacklevel=3)
        family = "default"
    return family


def pre_tokenizer_flags(family: str) -> dict:
    return dict(_PRE_FAMILIES[family][1])


class PreTokenizer:
    """Splits text into words with a sequence of regexes (see the module docstring)."""

    def __init__(self, family: str):
        self.family = family
        self._regexes = [_rx(p) for p in _PRE_FAMILIES[family][0]]

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        cats = text.translate(_CATEGORY_TABLE)
        spans = self._cut(self._regexes[0], cats, [(0, len(text))])
        for rx in self._regexes[1:]:
            spans = self._cut(rx, cats, spans)
        return [text[s:e] for s, e in spans]

    @staticmethod
    def _cut(rx: "re.Pattern[str]", cats: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Cut each span into the regex's matches and the gaps between them."""
        out = []
        append, search = out.append, rx.search
        for start, end in spans:
            m = search(cats, start, end)
            if m is None:  # common for the later, narrower regexes
                append((start, end))
                continue
            pos = start
            while m is not None:
                s, e = m.span()
                if s < e:
                    if s > pos:
                        append((pos, s))
                    append((s, e))
                    pos = e
                    m = search(cats, e, end)
                else:  # an empty match: look further on
                    m = search(cats, s + 1, end) if s < end else None
            if pos < end:
                append((pos, end))
        return out


def merge_ranks(merges: Iterable[str]) -> dict[str, int]:
    """"left right" -> rank of each merge (split at the first space after its first character;
    the first of duplicates)."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        if merge.find(" ", 1) > 0:
            ranks.setdefault(merge, rank)
    return ranks


def merged_ids(symbols, ranks: dict[str, int], vocab_get, fallback) -> tuple[int, ...]:
    """The ids of symbols merged by rank: each final piece's, or for a piece outside the
    vocabulary the ids fallback(piece) gives (None entries dropped)."""
    out = []
    for piece in bigram_merge(symbols, ranks, " "):
        tid = vocab_get(piece)
        if tid is not None:
            out.append(tid)
        else:
            out.extend(t for t in fallback(piece) if t is not None)
    return tuple(out)


class BpeEncoder:
    """Byte-level BPE with merge ranks and a per-word cache."""

    def __init__(self, vocab: dict[str, int], merges: Iterable[str], family: str, ignore_merges: bool):
        self._vocab = vocab
        # byte-level texts never contain a plain space
        self._ranks = merge_ranks(merges)
        self._pre = PreTokenizer(family)
        self._ignore_merges = ignore_merges
        self._cache = WordCache()

    def _encode_word(self, word: str) -> tuple[int, ...]:
        vocab_get = self._vocab.get
        mapped = bytes_to_bpe_text(word.encode("utf-8", "surrogateescape"))
        if self._ignore_merges:
            tid = vocab_get(mapped)
            if tid is not None:
                return (tid,)
        # A piece not in the vocabulary: llama.cpp looks up each single byte of its UTF-8 text;
        # only ASCII byte characters can match, anything else is dropped.
        return merged_ids(mapped, self._ranks, vocab_get,
                          lambda piece: [vocab_get(ch) for ch in piece if ch < "\x80"])

    def encode(self, text: str) -> list[int]:
        return encode_words(self._pre.split(text), self._cache, self._encode_word)


__all__ = [
    "BYTE_TO_CHAR", "CHAR_TO_BYTE", "bytes_to_bpe_text", "bpe_text_to_bytes", "PreTokenizer",
    "BpeEncoder", "pre_tokenizer_family", "pre_tokenizer_flags", "merge_ranks", "merged_ids",
]
