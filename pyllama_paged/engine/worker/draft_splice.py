"""Draft tokens spliced into a step's flat batch (speculative decoding). A draft
is not placed in the block pool: its tokens follow their item's last token at
the next positions, and their K/V go to the next slots of the block that holds
that token. The caller drafts only within that block, which the sequence holds
alone once its newest token is placed (copy-on-write happens at that append),
so a draft never writes a shared or cached block and a rejected token needs no
rollback: its slot is simply overwritten by the next token placed there. Every
draft token gets a logits row (the target's verdict on the draft so far)."""

from __future__ import annotations

import numpy as np


def block_room(position: int, block_size: int) -> int:
    """Slots after `position` in the block that holds it: the most tokens a draft
    following that position may take."""
    return block_size - 1 - position % block_size


def splice_drafts(tok, pos, slots, seqs, rows, counts, drafts: dict[int, list[int]], n_groups: int,
                  hidden_rows=None):
    """The batch with each drafts[i] inserted after item i's last token (items of
    `counts` tokens, in order): returns (tok, pos, slots, seqs, rows, hidden_rows) as new
    int32 arrays. Item i must have a logits row on its last token; its draft tokens
    get a row each, right after it."""
    n = len(tok)
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    order = sorted(i for i, d in drafts.items() if d)
    at = np.concatenate([np.full(len(drafts[i]), ends[i], dtype=np.int64) for i in order])
    last = at - 1                                   # each draft token's item's last token
    step = np.concatenate([np.arange(1, len(drafts[i]) + 1, dtype=np.int32) for i in order])
    values = np.concatenate([np.asarray(drafts[i], dtype=np.int32) for i in order])
    new_tok = np.insert(tok, at, values)
    new_pos = np.insert(pos, at, pos[last] + step)
    new_seqs = np.insert(seqs, at, seqs[last])
    runs = np.asarray(slots).reshape(n_groups, n)
    new_slots = np.concatenate([np.insert(run, at, run[last] + step) for run in runs])

    def moved(index):   # an old flat index's place after the insertions
        index = np.asarray(index, dtype=np.int64)
        return index + np.searchsorted(at, index, side="right")

    with_rows = set(np.asarray(rows).tolist())
    for i in order:
        if ends[i] - 1 not in with_rows:
            raise ValueError(f"item {i} gets a draft but computes no logits on its last token")
    # the draft tokens' own places: after their item's last token, in order
    draft_rows = moved(last) + step
    new_rows = np.sort(np.concatenate([moved(rows), draft_rows]))
    new_hidden = None if hidden_rows is None else moved(hidden_rows)
    as32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)   # noqa: E731
    return (as32(new_tok), as32(new_pos), as32(new_slots), as32(new_seqs), as32(new_rows),
            None if new_hidden is None else as32(new_hidden))
