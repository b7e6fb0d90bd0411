"""The vocabulary as llguidance sees it: one byte string per token id, with
control tokens marked so that no grammar can spell them out of text; and the
same bytes as the digit bound reads them (digits.py)."""

from __future__ import annotations

import threading
import weakref

import llguidance

from ..tokenizer.tokenizer import Tokenizer, TokenType
from .digits import DigitTable

# llguidance's convention: a leading 0xff byte marks a special token, which a
# grammar can only name explicitly (<|...|>) and never produce as text
_SPECIAL_MARK = b"\xff"
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED, TokenType.UNDEFINED)


def vocabulary_bytes(tokenizer: Tokenizer) -> tuple[list[bytes], list[int]]:
    """(bytes of each token id, ids of the special tokens)."""
    tokens, special = [], []
    for token_id, token_type in enumerate(tokenizer.token_types):
        if token_type in _SPECIAL_TYPES:
            special.append(token_id)
            tokens.append(_SPECIAL_MARK + tokenizer.tokens[token_id].encode("utf-8", "surrogateescape"))
        else:
            tokens.append(tokenizer.token_to_piece(token_id))
    return tokens, special


class _Wrapped:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.tokens, self.special_token_ids = vocabulary_bytes(tokenizer)
        self.eos_token_id = min(tokenizer.eot_ids) if tokenizer.eot_ids else None
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "surrogateescape")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class _Vocabulary:
    """What constraints need of one tokenizer, built once."""

    def __init__(self, tokenizer: Tokenizer):
        wrapped = _Wrapped(tokenizer)
        eos = sorted(tokenizer.eot_ids) or None
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapped), eos_token=eos)
        self.digits = DigitTable(wrapped.tokens, set(wrapped.special_token_ids))


_cache: "weakref.WeakKeyDictionary[Tokenizer, _Vocabulary]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _vocabulary(tokenizer: Tokenizer) -> _Vocabulary:
    with _lock:
        found = _cache.get(tokenizer)
        if found is None:
            found = _cache[tokenizer] = _Vocabulary(tokenizer)
        return found


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer, built once per tokenizer (about a second
    for a 262k vocabulary); every end-of-generation token ends a grammar."""
    return _vocabulary(tokenizer).ll


def digit_table(tokenizer: Tokenizer) -> DigitTable:
    """The tokenizer's tokens as the digit bound reads them, built with ll_tokenizer's."""
    return _vocabulary(tokenizer).digits
