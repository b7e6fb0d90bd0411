"""How many tokens to draft for a sequence this step. A drafted token costs a row of
the step whatever happens to it (on the default model on 2 cores, about 0.17 of a
one-token step: the 262k-row output head and a sampler draw per row), and it pays
only if every draft token before it is accepted too. So the d-th token is worth
drafting while P(the first d are accepted) exceeds that cost.

Acceptance comes in runs (a copied passage accepts token after token; free text
rejects the first), so two rates are learned per sequence, each a decaying count
with a prior: a1, that a draft's first token is accepted, and a2, that a token is
accepted after its predecessor was. P(first d accepted) = a1 * a2^(d-1). A sequence
that stops drafting has its counts drift back towards the prior, so it probes
again now and then (a text may start copying later)."""

from __future__ import annotations

# decaying counts: each verdict weighs this much less at every later verdict (about the
# last ten drafts count)
_DECAY = 0.9
# the prior a sequence starts from and drifts back to: (rate, weight in drafts)
_PRIOR_FIRST = (0.5, 2.0)
_PRIOR_NEXT = (0.8, 2.0)
# at each step a sequence does not draft, its counts shrink by this fraction
_IDLE_PULL = 0.02


class DraftLengths:
    """Per-sequence acceptance estimates and the draft length they make worth it."""

    def __init__(self, token_cost: float):
        self.token_cost = token_cost   # one draft token's cost, as a fraction of a one-token step
        # seq id -> [first hits, first tries, next hits, next tries], decaying
        self._counts: dict[int, list[float]] = {}

    def length(self, seq_id: int, most: int) -> int:
        """Tokens to draft for seq_id, at most `most` (0: drafting would not pay now)."""
        if self.token_cost <= 0:
            return most
        a1, a2 = self.rates(seq_id)
        d, p = 0, a1
        while d < most and p > self.token_cost:
            d += 1
            p *= a2
        if d == 0:
            counts = self._counts.get(seq_id)
            if counts is not None:   # drift towards the prior: a probe comes eventually
                self._counts[seq_id] = [c * (1 - _IDLE_PULL) for c in counts]
        return d

    def rates(self, seq_id: int) -> tuple[float, float]:
        """(a1, a2): P(a draft's first token is accepted), P(accepted | the previous one was)."""
        h1, t1, h2, t2 = self._counts.get(seq_id, (0.0, 0.0, 0.0, 0.0))
        (p1, w1), (p2, w2) = _PRIOR_FIRST, _PRIOR_NEXT
        return (h1 + p1 * w1) / (t1 + w1), (h2 + p2 * w2) / (t2 + w2)

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verdict: of `drafted` tokens, the first `accepted` were accepted."""
        if drafted <= 0:
            return
        h1, t1, h2, t2 = (c * _DECAY for c in self._counts.get(seq_id, (0.0, 0.0, 0.0, 0.0)))
        # positions after the first are tried only while every earlier one was accepted
        next_tries = min(accepted, drafted - 1)
        self._counts[seq_id] = [h1 + (accepted > 0), t1 + 1, h2 + max(0, accepted - 1), t2 + next_tries]

    def forget(self, seq_ids) -> None:
        """Ended sequences."""
        for seq_id in seq_ids:
            self._counts.pop(seq_id, None)
