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
import sys
from typing import Mapping, Optional, Sequence

import numpy as np

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space

# What a word cache may hold, in (estimated) bytes: bounding entries instead let a few
# thousand long words (a prompt of 1 MiB "words") hold gigabytes.
WORD_CACHE_BYTES = 32 << 20


def bigram_merge(symbols: Sequence[str], priority: Mapping[str, int], sep: str = "") -> list[str]:
    """Merge adjacent symbols greedily; return the final pieces in order.

    Two neighbours ``a`` and ``b`` may merge when ``a + sep + b`` is a key of ``priority``; its
    value, a non-negative integer rank, orders the merges (smaller first) and the leftmost pair
    wins ties. A heap holds the candidates, invalidated lazily: a candidate is stale once either
    of its symbols has changed length (symbols only grow, by absorbing their right neighbour, or
    become empty when absorbed). O(n log n) in the number of symbols.
    """
    n = len(symbols)
    if n < 2:
        return list(symbols)
    syms = list(symbols)
    # A candidate is one int, rank | left | size in bit fields, not a tuple: the heap then
    # compares machine-sized ints, several times faster on a long word's million candidates.
    # A symbol is named by the index it started at; its right neighbour is looked up when
    # the candidate comes out (the size says whether the pair is still the one pushed).
    bits = (n if isinstance(symbols, str) else max(n, sum(map(len, syms)))).bit_length()   # fits any size
    mask = (1 << bits) - 1
    shift = 2 * bits
    prio = priority.get
    ranks = list(map(prio, [a + sep + b for a, b in zip(syms, syms[1:])]))
    if isinstance(symbols, str):   # one character each: every pair's size is 2
        heap = [rank << shift | i << bits | 2 for i, rank in enumerate(ranks) if rank is not None]
    else:
        heap = [rank << shift | i << bits | len(syms[i]) + len(syms[i + 1])
                for i, rank in enumerate(ranks) if rank is not None]
    if not heap:
        return syms
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        entry = pop(heap)
        left = entry >> bits & mask
        a = syms[left]
        right = nxt[left]
        if not a or right < 0:
            continue  # stale: absorbed, or its neighbour was
        b = syms[right]
        if len(a) + len(b) != entry & mask:
            continue  # stale: one of the two grew since
        merged = a + b
        syms[left] = merged
        syms[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
            c = syms[after]
            rank = prio(merged + sep + c)
            if rank is not None:
                push(heap, rank << shift | left << bits | len(merged) + len(c))
        before = prv[left]
        if before >= 0:
            c = syms[before]
            rank = prio(c + sep + merged)
            if rank is not None:
                push(heap, rank << shift | before << bits | len(c) + len(merged))
    return [s for s in syms if s]


class SpmEncoder:
    """Encodes ``▁``-escaped text with score-ranked bigram merges and byte fallback."""

    def __init__(self, vocab: dict[str, int], scores: Sequence[float], unk_id: Optional[int]):
        self._vocab = vocab
        # merge priority of every vocabulary text as an integer rank: higher score merges
        # first, equal scores share a rank (the leftmost pair wins among them)
        order = np.unique(-np.asarray(scores, dtype=np.float64), return_inverse=True)[1].ravel().tolist()
        self._priority = {text: order[tid] for text, tid in vocab.items()}
        self._unk_id = unk_id
        self._byte_ids = [self._find_byte_token(b) for b in range(256)]
        self._cache = WordCache()
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


class WordCache:
    """Token ids of words already encoded, bounded by an estimate of the bytes held: when
    full it starts again empty; a word too big to be worth keeping is not kept."""

    def __init__(self, budget: int = WORD_CACHE_BYTES):
        self.budget = budget
        self.bytes = 0
        self._ids: dict[str, Sequence[int]] = {}

    def get(self, word: str):
        """The cached ids of word, or None."""
        return self._ids.get(word)

    def put(self, word: str, ids: Sequence[int]) -> None:
        """Keep word's ids while they fit."""
        # the two objects plus the dict slot and its hash-table share
        cost = sys.getsizeof(word) + sys.getsizeof(ids) + 100
        if cost > self.budget // 16:
            return
        if self.bytes + cost > self.budget:
            self.clear()
        self._ids[word] = ids
        self.bytes += cost

    def clear(self) -> None:
        """Forget every word."""
        self._ids.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._ids)


def encode_words(words, cache: WordCache, encode_word) -> list[int]:
    """The ids of words in order, each distinct word encoded once while it stays in the
    (bounded) cache: shared by the SPM and BPE encoders."""
    out: list[int] = []
    get = cache.get
    for word in words:
        ids = get(word)
        if ids is None:
            ids = encode_word(word)
            cache.put(word, ids)
        out.extend(ids)
    return out
