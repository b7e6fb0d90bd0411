"""Sampling parameters and the per-sequence sampler (NumPy over one logits row)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import PagedError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = True

    def validate(self) -> None:
        """Raise PagedError naming the first invalid field."""
        finite = math.isfinite
        checks = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "must be >= 0"),
            # 64-bit seeds, signed or not (read modulo 2**64, as llama.cpp casts them)
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**64, "must fit in 64 bits"),
            ("temperature", finite(self.temperature), "must be finite"),
            ("repeat_penalty", finite(self.repeat_penalty), "must be finite"),
            ("presence_penalty", finite(self.presence_penalty), "must be finite"),
            ("frequency_penalty", finite(self.frequency_penalty), "must be finite"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = disabled)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repeat_penalty", self.repeat_penalty > 0, "must be > 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("n", 1 <= self.n <= 64, "must be in [1, 64]"),
            ("beam_width", 1 <= self.beam_width <= 16, "must be in [1, 16]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise PagedError(f"sampling parameter '{name}' = {getattr(self, name)!r} {why}")

    def for_sample(self, index: int) -> "SamplingParams":
        """Parameters of the index-th of n samples: its own seed so samples differ."""
        if index == 0:
            return self
        return replace(self, seed=None if self.seed is None else self.seed + index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of a 1-D array (float64)."""
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Sampler:
    """Picks the next token of one sequence; owns its RNG so seeds reproduce."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """Repetition (llama.cpp style), presence and frequency penalties over the last n tokens."""
        p = self.params
        if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                           and p.frequency_penalty == 0.0):
            return logits
        recent = history[-p.penalty_last_n:] if p.penalty_last_n > 0 else history
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        out = logits.copy()
        vals = out[ids]
        with np.errstate(all="ignore"):  # extreme penalties overflow; sample() copes with inf
            if p.repeat_penalty != 1.0:
                vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            vals = vals - counts * p.frequency_penalty - (counts > 0) * p.presence_penalty
            out[ids] = vals
        return out

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        """The next token id from one row of logits."""
        p = self.params
        logits = self.apply_penalties(logits, history)
        if not np.isfinite(logits).all():
            # Big penalties overflow: a NaN never wins, +inf is the largest finite score.
            logits = np.nan_to_num(logits.astype(np.float64), nan=-np.inf,
                                   posinf=np.finfo(np.float64).max, neginf=-np.inf)
        if p.greedy:
            return int(np.argmax(logits))
        n = logits.shape[0]
        k = p.top_k if 0 < p.top_k < n else n
        # top-k first: partition is O(n) and shrinks everything after it
        if k < n:
            cand = np.argpartition(-logits, k - 1)[:k]
        else:
            cand = np.arange(n)
        cand = cand[np.argsort(-logits[cand], kind="stable")]
        best = float(logits[cand[0]])
        if best == -np.inf:  # every score is -inf: nothing to weigh
            return int(cand[0])
        # Differences from the best before dividing: a tiny temperature then
        # gives -inf (probability 0), never inf - inf = NaN.
        with np.errstate(over="ignore"):
            scaled = (logits[cand].astype(np.float64) - best) / p.temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        keep = len(cand)
        if p.min_p > 0:
            keep = min(keep, int(np.searchsorted(-probs, -probs[0] * p.min_p, side="right")))
        if p.top_p < 1.0:
            cum = np.cumsum(probs[:keep])
            keep = min(keep, int(np.searchsorted(cum, p.top_p, side="left")) + 1)
        keep = max(keep, 1)
        probs = probs[:keep] / probs[:keep].sum()
        return int(cand[self.rng.choice(keep, p=probs)])


def top_logprobs(logits: np.ndarray, chosen: int, n: int) -> tuple[float, dict[int, float]]:
    """Log-probability of the chosen token and the n most likely alternatives."""
    lp = log_softmax(logits)
    top = {}
    if n:
        idx = np.argpartition(-lp, n - 1)[:n]
        idx = idx[np.argsort(-lp[idx])]
        top = {int(i): float(lp[i]) for i in idx}
    return float(lp[chosen]), top
