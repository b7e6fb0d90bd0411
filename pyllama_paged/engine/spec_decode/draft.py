"""Speculative decoding's settings, and prompt-lookup drafting: no second model. A
sequence's newest tokens (an n-gram, longest first) are looked up earlier in its own
history (prompt + generated); the tokens that followed the latest earlier occurrence
are the draft. It pays where answers copy their prompt (code edits, summaries,
quotes). Knows nothing of the KV cache or the model (the draft-model drafter lives in
draft_model.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import PagedError
from ...flags import flagged

SPECULATIVE_METHODS = ("prompt_lookup", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding of an engine (None in EngineConfig: off). num_draft_tokens:
    the most tokens drafted per sequence and step. prompt_lookup tries n-grams of
    max_ngram down to min_ngram tokens; draft_model runs the GGUF at draft_model (same
    vocabulary as the target) greedily, its KV in its own pool of draft_kv_tokens
    tokens (None: as many as the target's pool holds). draft_token_cost: what one more
    draft token costs as a fraction of a one-token step; a sequence drafts only as many
    tokens as its acceptance so far makes worth that (spec_length.py; 0: always
    num_draft_tokens)."""

    method: str = flagged("prompt_lookup", "--speculative", "speculative decoding: prompt_lookup drafts from "
                          "earlier text of the same conversation, draft_model from a small model (--draft-model); a "
                          "request opts out with \"speculative\": false", choices=SPECULATIVE_METHODS)
    num_draft_tokens: int = flagged(4, "--num-draft-tokens", "most tokens drafted per step", type=int)
    max_ngram: int = flagged(3, "--max-ngram", "longest n-gram prompt lookup matches", type=int)
    min_ngram: int = 1
    draft_model: str | None = flagged(None, "--draft-model", "the GGUF that drafts for --speculative draft_model: "
                                      "a small model sharing the served model's tokenizer (it implies --speculative "
                                      "draft_model)", metavar="PATH")
    draft_kv_tokens: int | None = None
    draft_token_cost: float = 0.15

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise PagedError(f"speculative method {self.method!r} unknown: choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_draft_tokens <= 32:
            raise PagedError(f"num_draft_tokens must be in [1, 32], got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise PagedError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.method == "draft_model" and not self.draft_model:
            raise PagedError("speculative method 'draft_model' needs draft_model: the path of a GGUF "
                             "sharing the target's vocabulary")
        if self.method != "draft_model" and self.draft_model is not None:
            raise PagedError(f"draft_model is for method 'draft_model', not {self.method!r}")
        if not 0 <= self.draft_token_cost < 1:
            raise PagedError(f"draft_token_cost must be in [0, 1), got {self.draft_token_cost}")
        if self.draft_kv_tokens is not None and self.draft_kv_tokens < 1:
            raise PagedError(f"draft_kv_tokens must be >= 1 or None, got {self.draft_kv_tokens}")

    @classmethod
    def from_options(cls, values: dict) -> "SpeculativeConfig":
        """The config of the command line's options (flags.py): a draft model alone says the
        method; max_ngram is prompt lookup's alone."""
        given = {name: value for name, value in values.items() if value is not None}
        if given.get("method", "draft_model" if "draft_model" in given else None) == "draft_model":
            given.pop("max_ngram", None)
        return cls.parse(given)

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from what the surfaces accept: None/False (off), True or a method name
        (defaults), a dict of fields (a draft_model path without a method means
        method "draft_model"), or a SpeculativeConfig."""
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
            if value.get("draft_model") is not None and "method" not in value:
                value = {**value, "method": "draft_model"}
            return cls(**value)
        raise PagedError(f"speculative must be a dict, a method name or a bool, got {type(value).__name__}")


class PromptLookupDrafter:
    """Drafts a sequence's next tokens from an earlier occurrence of its last n-gram."""

    def __init__(self, config: SpeculativeConfig):
        self.max_ngram = config.max_ngram
        self.min_ngram = config.min_ngram
        self.num_draft_tokens = config.num_draft_tokens

    last_catch_up_tokens = 0   # nothing to catch up: the history is the draft's whole state

    def propose_many(self, wants: list[tuple[int, Sequence[int], int]],
                     catch_up_budget: int | None = None) -> list[list[int]]:
        """Drafts for [(seq id, token ids, most tokens)], one list each (possibly empty);
        catch_up_budget is a draft model's (a lookup costs no forward)."""
        return [self.propose(token_ids, k) for _, token_ids, k in wants]

    def retain(self, seq_ids) -> None:
        """Nothing to drop: prompt lookup keeps no state per sequence."""

    def release(self, seq_ids) -> None:
        """Nothing to free: prompt lookup keeps no state per sequence."""

    def close(self) -> None:
        """Nothing to close."""

    def stats(self) -> dict:
        """No counters of its own."""
        return {}

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
