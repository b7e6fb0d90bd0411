"""Conversations of a given token length as plain words, which every server tokenizes alike:
window_capacity.py's burst of chats and window_answers.py's check of the same conversations."""

from __future__ import annotations

import numpy as np

WORDS = ("river mountain quiet morning letter garden winter window story market bright silver engine "
         "travel history careful simple answer family evening number village summer forest ocean paper "
         "friend question reason music kitchen doctor teacher student city country light shadow "
         "library machine bridge harbor island candle stone cloud storm field").split()


def make_conversations(tokenizer, n: int, mean: float, out: int, seed: int, totals=None) -> list[dict]:
    """n prompts whose token counts follow the chat distribution (or are `totals`), as text
    both servers tokenize alike."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    if totals is None:
        totals = np.clip(rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size=n), 64, 2048).astype(int)
    convs = []
    for i, total in enumerate(totals):
        words = [WORDS[j] for j in rng.integers(len(WORDS), size=int(total) * 2)]
        ids = tokenizer.encode(" ".join(words), add_special=False)[:max(8, int(total) - out - 1)]
        text = tokenizer.decode_bytes(ids).decode("utf-8", "replace")
        convs.append({"prompt": text, "max_tokens": out, "target_tokens": int(total)})
    return convs
