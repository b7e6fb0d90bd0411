"""A thinking budget: at most N tokens inside a think block, then its closing tag is forced,
token by token, so the model goes on to its answer (llama.cpp's --reasoning-budget and its
request's reasoning_budget_tokens; Anthropic's thinking.budget_tokens). The tags are token
sequences, as the model writes them; a block the prompt opened counts from the first token.
Each further block the model opens gets the budget afresh."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    """The budget of one request: its size and the model's think tags as token ids."""

    tokens: int                      # thinking tokens at most per block (0: the block closed at once)
    open_ids: tuple[int, ...]        # the tag that opens a think block
    close_ids: tuple[int, ...]       # the tag that closes it: forced once the budget is spent
    opened: bool = False             # the prompt ends inside an open block

    def start(self) -> "BudgetState":
        """A sample's own count, at the start of its reply."""
        return BudgetState(self)


class BudgetState:
    """One sample's place: before a block, inside one (counting), forcing its close, or after."""

    __slots__ = ("budget", "state", "remaining", "forced_at", "recent")

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.recent: list[int] = []   # the last tokens, as many as the longer tag
        self.state, self.remaining, self.forced_at = "before", budget.tokens, 0
        if budget.opened:
            self._open()

    def _open(self) -> None:
        """A block opened: the budget afresh (forcing at once for a budget of 0)."""
        self.state, self.remaining, self.forced_at = "counting", self.budget.tokens, 0
        self.recent.clear()   # the open tag's tokens are no part of a close tag
        if self.remaining <= 0:
            self.state = "forcing"

    def _ends_with(self, tag: tuple[int, ...]) -> bool:
        return bool(tag) and len(self.recent) >= len(tag) and tuple(self.recent[-len(tag):]) == tag

    def _close_begun(self) -> int:
        """How many of the close tag's first tokens the last tokens are (0: none)."""
        close = self.budget.close_ids
        return next((k for k in range(len(close) - 1, 0, -1) if self._ends_with(close[:k])), 0)

    @property
    def forced(self) -> int | None:
        """The only token the next draw may take, while the close tag is forced; else None."""
        return self.budget.close_ids[self.forced_at] if self.state == "forcing" else None

    def accept(self, token: int) -> None:
        """Advance past a drawn token."""
        self.recent.append(token)
        del self.recent[:-max(len(self.budget.open_ids), len(self.budget.close_ids), 1)]
        if self.state == "forcing":
            self.forced_at += 1
            if self.forced_at >= len(self.budget.close_ids):
                self.state = "after"
        elif self.state == "counting":
            if self._ends_with(self.budget.close_ids):
                self.state = "after"   # closed by the model within its budget
                return
            self.remaining -= 1
            if self.remaining <= 0:   # a close tag the model has begun is finished, not begun again
                self.state, self.forced_at = "forcing", self._close_begun()
        elif self._ends_with(self.budget.open_ids):
            self._open()
