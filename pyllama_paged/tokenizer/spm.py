"""SentencePiece-style ("SPM") encoding, as llama.cpp does it for ``tokenizer.ggml.model = "llama"``.

The algorithm, on one raw-text fragment whose spaces were already replaced by ``▁`` (U+2581):

1. split the text into characters; every adjacent pair whose concatenation is a vocabulary
   entry is a merge candidate, ranked by that entry's score (higher first; the leftmost pair
   wins ties);
2. repeatedly merge the best candidate and add the candidates it creates with its neighbours;
3. each final piece becomes its token; a piece outside the vocabulary (an unknown single
   character) is spelled as byte tokens ``<0xXX>`` of its UTF-8 bytes ("byte fallback").

Merges are local, so the fragment is cut into words before each ``▁`` that cannot take part in
a merge with the character before it (decided from the vocabulary once), and each word's result
is cached. This gives the same tokens as running the merge over the whole fragment.

``bigram_merge`` is shared with the byte-level BPE encoder (``bpe``).
"""

from __future__ import annotations

import heapq
import re
from typing import Any, Mapping, Optional, Sequence

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space

_WORD_CACHE_LIMIT = 200_000


def bigram_merge(symbols: Sequence[str], priority: Mapping[str, Any], sep: str = "") -> list[str]:
    """Merge adjacent symbols greedily; return the final pieces in order.

    Two neighbours ``a`` and ``b`` may merge when ``a + sep + b`` is a key of ``priority``; its
    value orders the merges (smaller first) and the leftmost pair wins ties. A heap holds the
    candidates, invalidated lazily: a candidate is stale once either of its symbols has changed
    length (symbols only grow, by absorbing their right neighbour, or become empty when absorbed).
    """
    n = len(symbols)
    if n < 2:
        return list(symbols)
    syms = list(symbols)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    prio = priority.get
    heap = []
    for i in range(n - 1):
        key = prio(syms[i] + sep + syms[i + 1])
        if key is not None:
            heap.append((key, i, i + 1, len(syms[i]) + len(syms[i + 1])))
    if not heap:
        return syms
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, left, right, size = pop(heap)
        a, b = syms[left], syms[right]
        if not a or not b or len(a) + len(b) != size:
            continue  # stale candidate
        merged = a + b
        syms[left] = merged
        syms[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
            c = syms[after]
            key = prio(merged + sep + c)
            if key is not None:
                push(heap, (key, left, after, len(merged) + len(c)))
        before = prv[left]
        if before >= 0:
            c = syms[before]
            key = prio(c + sep + merged)
            if key is not None:
                push(heap, (key, before, left, len(c) + len(merged)))
    return [s for s in syms if s]


class SpmEncoder:
    """Encodes ``▁``-escaped text with score-ranked bigram merges and byte fallback."""

    def __init__(self, vocab: dict[str, int], scores: Sequence[float], unk_id: Optional[int]):
        self._vocab = vocab
        # merge priority of every vocabulary text: higher score merges first
        self._priority = {text: -scores[tid] for text, tid in vocab.items()}
        self._unk_id = unk_id
        self._byte_ids = [self._find_byte_token(b) for b in range(256)]
        self._cache: dict[str, tuple[int, ...]] = {}
        # Characters that some vocabulary entry joins to a following "▁" (e.g. ">▁</" in
        # Gemma 3). A "▁" after any other character starts a new, independent word.
        joiners = set()
        for text in vocab:
            start = text.find(SPACE_MARK, 1)
            while start > 0:
                if text[start - 1] != SPACE_MARK:
                    joiners.add(text[start - 1])
                start = text.find(SPACE_MARK, start + 1)
        not_before = re.escape(SPACE_MARK) + "".join(re.escape(c) for c in sorted(joiners))
        self._word_split = re.compile(f"(?<=[^{not_before}])(?={SPACE_MARK})")

    def _find_byte_token(self, byte: int) -> Optional[int]:
        tid = self._vocab.get(f"<0x{byte:02X}>")
        if tid is None:
            # llama.cpp then tries the one-byte string itself; GGUF texts that are not valid
            # UTF-8 are kept here with surrogate escapes, so a raw high byte looks like this.
            tid = self._vocab.get(chr(byte) if byte < 0x80 else chr(0xDC00 + byte))
        return tid if tid is not None else self._unk_id

    def _encode_word(self, word: str) -> tuple[int, ...]:
        out = []
        vocab_get = self._vocab.get
        for piece in bigram_merge(word, self._priority):
            tid = vocab_get(piece)
            if tid is not None:
                out.append(tid)
                continue
            for byte in piece.encode("utf-8", "surrogateescape"):
                bid = self._byte_ids[byte]
                if bid is None:
                    raise ValueError(f"cannot encode byte 0x{byte:02X}: no byte token and no <unk> token")
                out.append(bid)
        return tuple(out)

    def encode(self, text: str) -> list[int]:
        """Token ids of one fragment; ``text`` must already have spaces replaced by ``▁``."""
        return encode_words(self._word_split.split(text), self._cache, self._encode_word)


def encode_words(words, cache: dict, encode_word) -> list[int]:
    """The ids of words in order, each distinct word encoded once while it stays in the
    (bounded) cache: shared by the SPM and BPE encoders."""
    out: list[int] = []
    for word in words:
        ids = cache.get(word)
        if ids is None:
            ids = encode_word(word)
            if len(cache) >= _WORD_CACHE_LIMIT:
                cache.clear()
            cache[word] = ids
        out.extend(ids)
    return out
