"""Engine: runs sequences through the model with their KV in the chosen
allocator. One call to `step` is one batched forward over any mix of
sequences, each with any number of new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import PagedError
from .kv_allocators import PagedKV, SlabKV
from .model import Model
from .runner import ModelRunner


@dataclass
class SeqState:
    handle: int
    num_computed: int = 0                 # tokens whose KV is in the cache
    token_ids: list[int] = field(default_factory=list)


class Engine:
    """A model plus its KV cache, stepping batches of sequences."""

    def __init__(self, model: Model, *, paged: bool = True, n_ctx: int = 4096, n_seq_max: int = 1,
                 n_threads: int = 2, n_batch: int = 512, block_size: int = 32,
                 kv_cache_type: str = "f16", num_blocks: int | None = None):
        if n_ctx < 1 or n_batch < 1 or n_seq_max < 1:
            raise PagedError("n_ctx, n_batch and n_seq_max must be >= 1")
        if paged and not 1 <= block_size <= 1024:
            raise PagedError(f"block_size {block_size} out of range [1, 1024]")
        self.model = model
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        if paged:
            # Same KV budget as the slab baseline unless told otherwise.
            num_blocks = num_blocks or -(-n_ctx * n_seq_max // block_size)
            self.kv = PagedKV(num_blocks, block_size, n_ctx)
        else:
            self.kv = SlabKV(n_seq_max, n_ctx)
        self.runner = ModelRunner(model, kv_cache_type=kv_cache_type, num_blocks=self.kv.num_blocks,
                                  block_size=self.kv.block_size, paged=paged, n_threads=n_threads,
                                  max_batch_tokens=n_batch)

    @property
    def n_vocab(self) -> int:
        return self.model.config.n_vocab

    def add_sequence(self, token_ids: Sequence[int]) -> SeqState:
        """Place a new sequence's tokens in the KV cache (prefix-cache hits are kept)."""
        if len(token_ids) > self.n_ctx:
            raise PagedError(f"prompt of {len(token_ids)} tokens exceeds the context of {self.n_ctx}")
        handle, cached = self.kv.create(token_ids)
        # The pool never counts the last token as cached: its logits start generation.
        return SeqState(handle, cached, list(token_ids))

    def append_tokens(self, seq: SeqState, token_ids: Sequence[int]) -> None:
        """Reserve KV room for new tokens (copy-on-write done here)."""
        if len(seq.token_ids) + len(token_ids) > self.n_ctx:
            raise PagedError(f"sequence would exceed the context of {self.n_ctx} tokens")
        self.runner.copy_blocks(self.kv.append(seq.handle, token_ids))
        seq.token_ids.extend(token_ids)

    def fork(self, seq: SeqState) -> SeqState:
        """A sequence sharing all of seq's KV pages."""
        return SeqState(self.kv.fork(seq.handle), seq.num_computed, list(seq.token_ids))

    def free(self, seq: SeqState) -> None:
        """Release a sequence's KV (computed full pages stay in the prefix cache)."""
        self.kv.free(seq.handle)

    def step(self, work: Sequence[tuple[SeqState, int]]) -> np.ndarray:
        """Compute the next n tokens of each (seq, n); returns each one's last logits row."""
        total = sum(n for _, n in work)
        if total > self.n_batch:
            raise PagedError(f"step of {total} tokens exceeds n_batch {self.n_batch}")
        tok, pos, slots, seq_index, rows = [], [], [], [], []
        tables = np.full((len(work), self.kv.max_blocks_per_seq), -1, dtype=np.int32)
        for i, (seq, n) in enumerate(work):
            start = seq.num_computed
            if n < 1 or start + n > len(seq.token_ids):
                raise PagedError(f"cannot compute {n} tokens at {start} of a {len(seq.token_ids)}-token sequence")
            tok.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.append(self.kv.slot_mapping(seq.handle, start, n))
            seq_index.extend([i] * n)
            table = self.kv.block_table(seq.handle)
            tables[i, :len(table)] = table
            rows.append(len(tok) - 1)
        logits = self.runner.forward(tok, pos, np.concatenate(slots), seq_index, tables, rows)
        for seq, n in work:
            seq.num_computed += n
            self.kv.mark_computed(seq.handle, seq.num_computed)
        return logits

    def prefill(self, seq: SeqState) -> np.ndarray:
        """Compute all of seq's pending tokens in n_batch chunks; returns the last logits row."""
        logits = None
        while seq.num_computed < len(seq.token_ids):
            n = min(self.n_batch, len(seq.token_ids) - seq.num_computed)
            logits = self.step([(seq, n)])[0]
        if logits is None:
            raise PagedError("nothing to compute: the sequence is empty")
        return logits

    def close(self) -> None:
        """Free the KV cache and compute context."""
        self.runner.close()
        self.kv.close()
