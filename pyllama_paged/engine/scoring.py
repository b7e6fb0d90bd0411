"""Prompt scoring in the engine (OpenAI completions' echo with logprobs, as
lm-evaluation-harness asks for it): a scoring request is an ordinary request
to the scheduler that prefills on fresh pages (every position's logits are
wanted, so nothing comes from the prefix cache), at most MAX_SCORE_ROWS
positions per step beside other users' work, and is never sampled: each
chunk returns the logits of all its positions, which are scored at once, so
a long prompt never holds a [prompt, vocabulary] array."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .worker.sampler import log_softmax

TokenScore = tuple[float | None, dict[int, float]]   # (log p(token | before), top_n best there)


def score_rows(logits: np.ndarray, token_ids, start: int, top_n: int) -> list[TokenScore]:
    """The scores of positions start+1 .. start+len(logits) of token_ids: row k predicts
    token start+k+1 (a row past the last token scores nothing)."""
    out = []
    for k in range(len(logits)):
        nxt = start + k + 1
        if nxt >= len(token_ids):
            break
        lp = log_softmax(logits[k])
        top = {}
        if top_n > 0:
            best = np.argpartition(-lp, top_n)[:top_n]
            top = {int(t): float(lp[t]) for t in best[np.argsort(-lp[best])]}
        out.append((float(lp[token_ids[nxt]]), top))
    return out


@dataclass
class PromptScores:
    """The scores of the scoring sequences in flight, by sequence id (the first token has none)."""

    scores: dict[int, list[TokenScore]] = field(default_factory=dict)

    def add(self, seq_id: int, token_ids, start: int, logits: np.ndarray, top_n: int) -> None:
        self.scores.setdefault(seq_id, [(None, {})]).extend(score_rows(logits, token_ids, start, top_n))

    def pop(self, seq_id: int) -> list[TokenScore]:
        return self.scores.pop(seq_id)

    def forget(self, seq_id: int) -> None:
        self.scores.pop(seq_id, None)
