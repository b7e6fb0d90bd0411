"""The sampling rules in plain NumPy, as one probability vector over the
vocabulary: the reference the native batched sampler is checked against."""

import numpy as np


def reference_probs(logits, history, params) -> np.ndarray:
    """Probability of each token under params after penalties, top-k, min-p and top-p
    (top-p and min-p over the distribution renormalized within the top-k)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    p = params
    recent = history[-p.penalty_last_n:] if p.penalty_last_n > 0 else history
    if len(recent) and (p.repeat_penalty != 1 or p.presence_penalty or p.frequency_penalty):
        ids, counts = np.unique(np.asarray(recent), return_counts=True)
        v = x[ids]
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        x[ids] = v - counts * p.frequency_penalty - p.presence_penalty
    out = np.zeros_like(x)
    if p.temperature == 0:
        out[np.argmax(x)] = 1.0
        return out
    order = np.argsort(-x, kind="stable")
    if 0 < p.top_k < len(x):
        order = order[:p.top_k]
    w = np.exp((x[order] - x[order[0]]) / p.temperature)
    probs = w / w.sum()
    keep = len(order)
    if p.min_p > 0:
        keep = min(keep, int(np.sum(probs >= probs[0] * p.min_p)))
    if p.top_p < 1:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1)
    keep = max(keep, 1)
    out[order[:keep]] = probs[:keep] / probs[:keep].sum()
    return out
