"""Gemma 4's tokenizer (``tokenizer.ggml.model = "gemma4"``), as llama.cpp runs it: BPE with
merge ranks, but over text written as SentencePiece writes it, not GPT-2's byte characters.

1. Spaces become ``▁`` (U+2581) and the text is cut into runs of newlines and runs of anything
   else (llama.cpp's pre-tokenizer for it; no other word splitting).
2. A run of newlines that is a vocabulary entry is that one token.
3. Otherwise the run's characters are merged by rank (``tokenizer.ggml.merges``, lowest first,
   leftmost first on ties) and each final piece is looked up; a piece outside the vocabulary is
   spelled as byte tokens ``<0xXX>`` of its UTF-8 bytes (those the vocabulary has).

Pieces decode as SentencePiece's do: ``▁`` back to a space, byte tokens to their byte.
"""

from __future__ import annotations

import re
from typing import Iterable

from .bpe import merge_ranks, merged_ids
from .spm import SPACE_MARK, WordCache, encode_words

_RUNS = re.compile(r"[^\n]+|\n+")


class Gemma4Encoder:
    """Merge-rank BPE over ▁-escaped characters, a cache of the words seen."""

    def __init__(self, vocab: dict[str, int], merges: Iterable[str]):
        self._vocab = vocab
        self._ranks = merge_ranks(merges)
        self._cache = WordCache()

    def _encode_word(self, word: str) -> tuple[int, ...]:
        get = self._vocab.get
        if word[0] == "\n" and (tid := get(word)) is not None:
            return (tid,)
        return merged_ids(word, self._ranks, get,
                          lambda piece: [get(f"<0x{b:02X}>") for b in piece.encode("utf-8", "surrogateescape")])

    def encode(self, text: str) -> list[int]:
        """Token ids of one raw-text fragment."""
        return encode_words(_RUNS.findall(text.replace(" ", SPACE_MARK)), self._cache, self._encode_word)
