"""Layer groups of the KV cache. Layers that attend over the same span (all
tokens, or a sliding window of one size) share a block table per sequence;
groups are made the same size so that a physical block, whichever group
takes it, costs the same bytes (the i-th layer of every group shares one
pool tensor). Where layers differ in K/V row width (Gemma 4's sliding and full
layers), groups are cut so that their layers' rows side by side fill slots of
one width (for_layers), and a layer that reads an earlier layer's KV joins
that layer's group and owns no rows. A window group gives its blocks back once
no later query can see them, so a long sequence holds only the window there."""

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

    @classmethod
    def for_layers(cls, layer_window: Sequence[int], kv_values: Sequence[int],
                   kv_source: Sequence[int] = ()) -> "KVGroups":
        """Groups for layers of their own spans, K/V row widths (kv_values[il] values) and KV
        sources (kv_source[il] >= 0: layer il reads that earlier layer's KV and joins its group;
        empty: every layer keeps its own). Layers of one width: for_windows over the layers that
        keep KV. Otherwise each span's layers are cut into groups whose rows fill one slot width,
        chosen so that full-attention groups waste none of it where they can (a window group's
        waste lasts only its window's blocks), then the fewest groups."""
        owners = [il for il in range(len(layer_window)) if not kv_source or kv_source[il] < 0]
        if len({kv_values[il] for il in owners}) == 1 and len(owners) == len(layer_window):
            return cls.for_windows(layer_window)
        spans = {w: [il for il in owners if layer_window[il] == w] for w in sorted({layer_window[il] for il in owners})}
        width = {w: max(kv_values[il] for il in layers) for w, layers in spans.items()}
        if len(set(width.values())) == 1:
            per_group = dict.fromkeys(spans, math.gcd(*(len(layers) for layers in spans.values())))
        else:
            slot = _slot_width(spans, width)
            per_group = {w: slot // width[w] for w in spans}
        layer_group = [-1] * len(layer_window)
        group_window: list[int] = []
        for w, layers in spans.items():
            for start in range(0, len(layers), per_group[w]):
                for il in layers[start:start + per_group[w]]:
                    layer_group[il] = len(group_window)
                group_window.append(w)
        for il in range(len(layer_window)):
            if layer_group[il] < 0:
                layer_group[il] = layer_group[kv_source[il]]
        return cls(tuple(layer_group), tuple(group_window))

    def slot_values(self, kv_values: Sequence[int], kv_source: Sequence[int] = ()) -> int:
        """K (or V) values one slot of a block holds: the widest group's layers' rows side by side
        (the native pools' layout; a layer that reads another's KV holds none)."""
        used = [0] * self.n_groups
        for il, g in enumerate(self.layer_group):
            if not kv_source or kv_source[il] < 0:
                used[g] += kv_values[il]
        return max(used)

    def steady_bytes(self, slot_bytes: int, block_size: int, num_tokens: int) -> int:
        """KV bytes one sequence of num_tokens computed tokens holds (all groups), the
        window groups holding only their window's blocks plus the current one."""
        blocks = -(-num_tokens // block_size)
        held = sum(blocks - first_needed_block(w, block_size, num_tokens) for w in self.group_window)
        return held * slot_bytes * block_size


def _slot_width(spans: dict[int, list[int]], width: dict[int, int]) -> int:
    """The slot width (values) for spans of layers of different row widths: each span's groups
    hold slot // width of its layers. Candidates are a span's width times a divisor of its layer
    count (a span then fills its groups exactly); the least wasted by full-attention groups wins,
    then by window groups, then the widest (the fewest groups)."""
    def waste(slot: int, full: bool) -> int:
        return sum(-(-len(layers) // (slot // width[w])) * slot - len(layers) * width[w]
                   for w, layers in spans.items() if (w <= 0) == full)

    candidates = {width[w] * d for w, layers in spans.items() for d in range(1, len(layers) + 1) if len(layers) % d == 0}
    fits = [slot for slot in candidates if slot >= max(width.values())]
    return min(fits, key=lambda slot: (waste(slot, True), waste(slot, False), -slot))


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
