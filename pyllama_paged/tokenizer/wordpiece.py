"""WordPiece, BERT's tokenizer (GGUF ``tokenizer.ggml.model`` = "bert").

Text is first split into words the way BERT's "basic tokenizer" does: control
characters dropped, whitespace runs as separators, CJK ideographs and every
punctuation or ASCII symbol character a word of its own; then lower-cased with
accents stripped (NFD, combining marks removed), as uncased BERT models were
trained. Each word is then cut greedily into the longest vocabulary pieces from
its start; a word that cannot be cut, or longer than 100 characters, becomes
the unknown token.

Vocabularies come in two spellings, both read: llama.cpp's (a word-initial
piece starts with "\u2581", a continuation piece is bare) and vocab.txt's
(a word-initial piece is bare, a continuation starts with "##").
"""

from __future__ import annotations

import unicodedata

from .spm import WordCache

MAX_WORD_CHARS = 100     # longer words are one unknown token (BERT's max_input_chars_per_word)
WORD_START = "\u2581"


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # ASCII symbols such as $ + ^ ` count as punctuation too
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")


def _fold(word: str) -> str:
    """Lower-case and strip accents (NFD, then drop combining marks)."""
    return "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")


def split_words(text: str, lowercase: bool = True) -> list[str]:
    """BERT's basic tokenization: the words WordPiece then cuts into pieces."""
    words: list[str] = []
    current: list[str] = []

    def flush():
        if current:
            words.append("".join(current))
            current.clear()

    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            flush()
        elif _is_cjk(cp):
            flush()
            words.append(ch)
        else:
            current.append(ch)
    flush()
    out: list[str] = []
    for word in words:
        if lowercase:
            word = _fold(word)
        # punctuation splits after folding: NFD may have exposed some
        start = 0
        for i, ch in enumerate(word):
            if _is_punctuation(ch):
                if i > start:
                    out.append(word[start:i])
                out.append(ch)
                start = i + 1
        if start < len(word):
            out.append(word[start:])
    return out


class WordPieceEncoder:
    """Greedy longest-match WordPiece over a vocabulary {piece: id}."""

    def __init__(self, vocab: dict[str, int], unk_id: int | None, lowercase: bool = True):
        self.vocab = vocab
        self.unk_id = unk_id
        self.lowercase = lowercase
        # llama.cpp's spelling marks word starts; vocab.txt's marks continuations
        self.marks_word_start = any(t.startswith(WORD_START) for t in vocab)
        self._cache = WordCache()

    def _piece_id(self, piece: str, first: bool) -> int | None:
        if self.marks_word_start:
            return self.vocab.get(WORD_START + piece if first else piece)
        return self.vocab.get(piece if first else "##" + piece)

    def encode_word(self, word: str) -> list[int]:
        """One word's pieces; [unk] when it cannot be cut."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids = self._cut(word) if len(word) <= MAX_WORD_CHARS else None
        if ids is None:
            ids = [self.unk_id] if self.unk_id is not None else []
        self._cache.put(word, ids)
        return ids

    def _cut(self, word: str) -> list[int] | None:
        """Longest vocabulary pieces from the word's start; None if some rest matches nothing."""
        ids: list[int] = []
        start = 0
        while start < len(word):
            for end in range(len(word), start, -1):
                tid = self._piece_id(word[start:end], start == 0)
                if tid is not None:
                    ids.append(tid)
                    start = end
                    break
            else:
                return None
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of a text fragment (no [CLS]/[SEP]: the Tokenizer adds those)."""
        out: list[int] = []
        for word in split_words(text, self.lowercase):
            out.extend(self.encode_word(word))
        return out

    def piece_text(self, token: str) -> str:
        """How a piece reads in decoded text: word starts get their space back."""
        if self.marks_word_start:
            return " " + token[1:] if token.startswith(WORD_START) else token
        return token[2:] if token.startswith("##") else " " + token
