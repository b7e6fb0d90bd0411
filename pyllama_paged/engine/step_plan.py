"""What the scheduler decided for one step, as plain data: the tokens each
sequence computes, and the KV data that must move first (host copies of
swapped-out pages, swapped-in pages written back, copy-on-write copies).
The scheduler only keeps the books (block tables, via the KV manager); the
engine carries the data moves out through the model runner, then runs the
forward step over `work`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .request import Sequence


@dataclass
class StepPlan:
    """One step, decided: work in batch order (decodes first), then the KV moves."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)      # (sequence, tokens to compute)
    num_decodes: int = 0                                                # the first num_decodes items of work
    swap_out: list[tuple[Sequence, dict[tuple[int, int], int]]] = field(default_factory=list)
    swap_in: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (block, host copy)
    block_copies: list[tuple[int, int]] = field(default_factory=list)    # copy-on-write (src, dst)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.work[self.num_decodes:])

    def carry_out(self, runner) -> None:
        """Move the KV data the plan needs, in the one safe order: read every swapped-out
        page (its block may be handed to another sequence in this same plan), then write
        swapped-in pages, then copy-on-write."""
        for seq, blocks in self.swap_out:
            seq.swapped_blocks = {key: runner.read_block(block) for key, block in blocks.items()}
        for block, data in self.swap_in:
            runner.write_block(block, data)
        runner.copy_blocks(self.block_copies)
