"""Layer groups of the KV cache. Layers that attend over the same span (all
tokens, or a sliding window of one size) share a block table per sequence;
groups are made the same size so that a physical block, whichever group
takes it, costs the same bytes (the i-th layer of every group shares one
pool tensor). A window group gives its blocks back once no later query can
see them, so a long sequence holds only the window there."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KVGroups:
    """Which group each layer is in, and each group's window (0: all tokens)."""

    layer_group: tuple[int, ...]
    group_window: tuple[int, ...]

    @property
    def n_groups(self) -> int:
        return len(self.group_window)

    @property
    def layers_per_group(self) -> int:
        return len(self.layer_group) // self.n_groups

    @property
    def window_groups(self) -> int:
        """Groups that free blocks past their window."""
        return sum(1 for w in self.group_window if w > 0)

    @classmethod
    def single(cls, n_layer: int) -> "KVGroups":
        """Every layer in one group that keeps every token (no freeing)."""
        return cls((0,) * n_layer, (0,))

    @classmethod
    def for_windows(cls, layer_window: Sequence[int]) -> "KVGroups":
        """Groups for a model whose layer il attends over layer_window[il] tokens (0: all).
        Layers of one span are cut, in order, into groups of the greatest common divisor
        of the spans' layer counts."""
        spans = sorted(set(layer_window))          # 0 (full attention) first
        counts = {w: sum(1 for x in layer_window if x == w) for w in spans}
        size = math.gcd(*counts.values())
        layer_group = [0] * len(layer_window)
        group_window: list[int] = []
        for w in spans:
            layers = [il for il, x in enumerate(layer_window) if x == w]
            for start in range(0, len(layers), size):
                for il in layers[start:start + size]:
                    layer_group[il] = len(group_window)
                group_window.append(w)
        return cls(tuple(layer_group), tuple(group_window))

    def steady_bytes(self, slot_bytes: int, block_size: int, num_tokens: int) -> int:
        """KV bytes one sequence of num_tokens computed tokens holds (all groups), the
        window groups holding only their window's blocks plus the current one."""
        blocks = -(-num_tokens // block_size)
        held = sum(blocks - first_needed_block(w, block_size, num_tokens) for w in self.group_window)
        return held * slot_bytes * block_size


# The sliding-window block rules, in one place (the native pool applies the first as
# pp_group_first_needed when it gives a window group's blocks back).
def first_needed_block(window: int, block_size: int, num_computed: int) -> int:
    """The first block of a window group that a query after num_computed computed tokens
    can still see (0 for full attention): the blocks before it are given back."""
    if window <= 0 or num_computed - window + 1 <= 0:
        return 0
    return (num_computed - window + 1) // block_size


def window_blocks_held(window: int, block_size: int, placed: int) -> int:
    """The most blocks a window group holds while `placed` more tokens are placed at once
    beyond what its queries still see: the window and those tokens, plus one block that
    the window's start leaves partly used."""
    return -(-(window + placed) // block_size) + 1
