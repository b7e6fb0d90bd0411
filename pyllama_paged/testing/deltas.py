"""Ways to cut a reply into streamed deltas, for the tests of what splits a stream (reasoning,
harmony, tool calls): the split must not depend on where the deltas fall."""

from __future__ import annotations

import random


def delta_cuts(text: str, most: int) -> list[list[int]]:
    """Cut points into text: every single cut, 20 seeded draws of up to `most` cuts, and one
    character at a time."""
    rng = random.Random(len(text))
    ends = range(len(text) + 1)
    return [[i] for i in ends] + [sorted(rng.sample(ends, min(most, len(text)))) for _ in range(20)] + [list(ends)]
