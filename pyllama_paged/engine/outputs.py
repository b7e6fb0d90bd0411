"""What the engine gives back per step: token events and each moved request's output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenEvent:
    seq_index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    events: list[TokenEvent] = field(default_factory=list)
    finished: bool = False
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None
    beams: list[tuple[list[int], float]] | None = None   # (output ids, score), best first
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    embedding: np.ndarray | None = None   # an embedding request's pooled vector, when it finishes
    prompt_logprobs: list | None = None   # a scoring request's [(logprob, top)] per prompt token, when it finishes
