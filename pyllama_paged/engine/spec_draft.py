"""Prompt-lookup drafting for speculative decoding: no second model. A sequence's
newest tokens (an n-gram, longest first) are looked up earlier in its own history
(prompt + generated); the tokens that followed the latest earlier occurrence are
the draft. It pays where answers copy their prompt (code edits, summaries,
quotes). Knows nothing of the KV cache or the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import PagedError

SPECULATIVE_METHODS = ("prompt_lookup",)


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding of an engine (None in EngineConfig: off). num_draft_tokens:
    the most tokens drafted per sequence and step; the drafter tries n-grams of
    max_ngram down to min_ngram tokens."""

    method: str = "prompt_lookup"
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise PagedError(f"speculative method {self.method!r} unknown: choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_draft_tokens <= 32:
            raise PagedError(f"num_draft_tokens must be in [1, 32], got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise PagedError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from what the surfaces accept: None/False (off), True or a method name
        (defaults), a dict of fields, or a SpeculativeConfig."""
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if value is True:
            return cls()
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise PagedError(f"speculative: unknown field(s) {', '.join(sorted(unknown))}")
            return cls(**value)
        raise PagedError(f"speculative must be a dict, a method name or a bool, got {type(value).__name__}")


class PromptLookupDrafter:
    """Drafts a sequence's next tokens from an earlier occurrence of its last n-gram."""

    def __init__(self, config: SpeculativeConfig):
        self.max_ngram = config.max_ngram
        self.min_ngram = config.min_ngram
        self.num_draft_tokens = config.num_draft_tokens

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to max_tokens (default num_draft_tokens) tokens that followed the latest
        earlier occurrence of the longest matching suffix n-gram; [] if none occurs."""
        k = self.num_draft_tokens if max_tokens is None else min(max_tokens, self.num_draft_tokens)
        n_total = len(token_ids)
        if k <= 0 or n_total < self.min_ngram + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, n_total - 1), self.min_ngram - 1, -1):
            start = _latest_occurrence(ids, n)
            if start >= 0:
                follow = start + n
                return ids[follow:follow + k].tolist()
        return []


def _latest_occurrence(ids: np.ndarray, n: int) -> int:
    """Start of the latest occurrence of ids' last n tokens that ends before the end
    (so at least one token follows it); -1 if none."""
    suffix = ids[-n:]
    # candidate starts s with s + n < len(ids): the match is followed by a token
    last_start = len(ids) - n - 1
    if last_start < 0:
        return -1
    match = ids[:last_start + 1] == suffix[0]
    for j in range(1, n):
        match &= ids[j:last_start + 1 + j] == suffix[j]
    hits = np.flatnonzero(match)
    return int(hits[-1]) if hits.size else -1
