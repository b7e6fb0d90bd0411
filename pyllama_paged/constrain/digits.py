"""JSON numbers with a bounded count of digits, for every JSON constraint.

llguidance compiles a schema's `integer` and `number` (and any value of an open object) into
digits without end: a small model that prefers digits writes `"age": 150000000...` until the
context runs out, and the answer never parses. llama.cpp's schema grammars bound each part of a
number: at most 16 digits before the point, after it and in the exponent. llguidance's compiler
has no such option, and a schema cannot say it (`multipleOf` bounds a fraction only to 10
digits, a range forbids exponents), so the bound is kept beside the grammar instead: one
sequence's `DigitRun` follows the text outside JSON strings, and while the run of digits it is
in is near the bound, the row's mask refuses every token that would lengthen it past. Digits
inside strings are text and are not counted. The schema's own `minimum`/`maximum` stay
llguidance's to honour; a schema whose numbers (a bound, a `const`, an `enum`) have longer digit
runs raises the bound to fit them, so that no schema is made unsatisfiable.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

DIGIT_BOUND = 16   # digits in a run outside strings: an integral part, a fraction or an exponent
_DIGITS = re.compile(rb"[0-9]+")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_MAX_MASKS = 64


def _longest_run(data: bytes) -> int:
    return max((len(m) for m in _DIGITS.findall(data)), default=0)


def schema_digit_bound(schema: Any) -> int:
    """DIGIT_BOUND, or the longest digit run of a number the schema itself writes (a bound, a
    const, an enum member), if longer: those values must stay reachable."""
    longest, stack = 0, [schema]
    while stack:   # no recursion: a schema may nest deeply
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            longest = max(longest, _digits(item))
    return max(DIGIT_BOUND, longest)


def _digits(value: int | float) -> int:
    """The longest digit run of a number as JSON may write it (1e16 is 17 digits when whole)."""
    longest = _longest_run(repr(value).encode())
    if isinstance(value, float) and math.isfinite(value):
        longest = max(longest, len(str(int(abs(value)))))
    return longest


class DigitTable:
    """Per vocabulary: each token's bytes, its leading digits (which continue a run) and its
    longest later digit run; the masks of tokens that a run of a given length still admits."""

    def __init__(self, pieces: list[bytes], special: set[int]):
        self.pieces = pieces
        n = len(pieces)
        self.lead = np.zeros(n, dtype=np.int32)
        self.later = np.zeros(n, dtype=np.int32)
        for token_id, piece in enumerate(pieces):
            if token_id in special or not piece:
                continue
            digits = len(piece) - len(piece.lstrip(b"0123456789"))
            self.lead[token_id] = digits
            if digits < len(piece):
                self.later[token_id] = _longest_run(piece[digits:])
        self.most_lead, self.most_later = int(self.lead.max(initial=0)), int(self.later.max(initial=0))
        self._masks: dict = {}

    def admits(self, run: int, bound: int) -> np.ndarray | None:
        """uint8 mask of the tokens that keep every run within bound after a run of `run`
        digits outside strings; None when every token does (the usual case)."""
        room = bound - run
        if room >= self.most_lead and self.most_later <= bound:
            return None
        # keyed by what the mask depends on: a few rooms below most_lead, so requests' own
        # bounds cannot fill memory with masks (and the odd vocabulary's pairs are capped)
        key = room if self.most_later <= bound else (room, bound)
        mask = self._masks.get(key)
        if mask is None:
            # a token is judged as if its later runs were outside strings too: only tokens
            # holding more than `bound` digits in a row are refused for that, and none of a
            # real vocabulary's do
            refused = (self.lead > max(room, 0)) | (self.later > bound)
            if len(self._masks) >= _MAX_MASKS:
                self._masks.clear()
            mask = self._masks[key] = (~refused).astype(np.uint8)
        return mask


class DigitRun:
    """Where one sequence's JSON text stands: in a string (after a backslash), or outside
    strings after a run of some digits."""

    __slots__ = ("table", "bound", "in_string", "escaped", "run")

    def __init__(self, table: DigitTable, bound: int):
        self.table, self.bound = table, bound
        self.in_string = self.escaped = False
        self.run = 0

    def advance(self, token_id: int) -> None:
        """Move past a sampled token's bytes."""
        for byte in self.table.pieces[token_id]:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == _BACKSLASH:
                    self.escaped = True
                elif byte == _QUOTE:
                    self.in_string = False
            elif 48 <= byte <= 57:
                self.run += 1
            else:
                self.run = 0
                self.in_string = byte == _QUOTE

    def admits(self) -> np.ndarray | None:
        """The tokens allowed next (a uint8 mask), or None when the bound refuses none."""
        return self.table.admits(0 if self.in_string else self.run, self.bound)
