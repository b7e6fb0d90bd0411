"""A small draft model for speculative decoding: a second GGUF sharing the target's
vocabulary proposes each sequence's next tokens greedily (argmax), which is a
deterministic draft, so Speculator.verify's accept-iff-draw-equals-draft rule stays
exact (the output is the target's at any temperature).

The draft model has its own ModelRunner and paged pool. A draft sequence mirrors
one target sequence: each step it is caught up with the target's tokens (placed
and computed, every speculating sequence in one batched forward; the last of
these gives the first draft token), then k - 1 greedy steps run batched across
sequences. Those draft tokens are never placed: like the target's spliced drafts
(worker/draft_splice.py) they take the positions and slots after the newest placed token,
inside its block (the attention kernel attends by position), and the next catch-up
places whichever of them the target accepted and computes them again. Recomputing
a few accepted tokens is cheaper than tracking which draft slots survived, and
keeps the draft pool's blocks holding exactly the target's tokens (so its prefix
cache serves n>1 samples and repeated prompts). Draft sequences are freed when
their target sequence ends or is preempted (Speculator.forget / retain).

A draft sequence that lags by more than one verified draft leaves behind (a prompt
it has not seen, a stretch of steps without drafting) is caught up in pieces out
of the step's spare prefill budget (Scheduler.spare_prefill_tokens), earliest
sequence first, and drafts nothing until a piece reaches the target's newest
token (it decodes without drafts meanwhile): a whole long prompt computed inside
one step would stall every running stream for as long as the prefill the
scheduler spread over many steps."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ...errors import OutOfBlocksError, PagedError
from ..kv.manager import SeqState, place_tokens
from ..worker.model import Model
from ..worker.model_runner import ModelRunner, dense_kv_bytes_per_token
from ..worker.draft_splice import block_room
from .draft import SpeculativeConfig


def check_same_vocab(draft: Model, target: Model) -> None:
    """PagedError unless draft's tokenizer is target's (size and every token)."""
    n_draft, n_target = draft.config.n_vocab, target.config.n_vocab
    problem = None
    if n_draft != n_target:
        problem = f"{n_draft} tokens against {n_target}"
    elif draft.metadata.get("tokenizer.ggml.tokens") != target.metadata.get("tokenizer.ggml.tokens"):
        problem = "the same size but different tokens"
    if problem:
        raise PagedError(f"draft model {draft.path} does not share the vocabulary of the target model "
                         f"{target.path} ({problem}): a draft model must use the target's tokenizer")


def load_draft_runner(spec: SpeculativeConfig, target: Model, target_runner: ModelRunner, config) -> ModelRunner:
    """The draft model's runner: spec.draft_model loaded (vocabulary checked against
    target's) on the GPU layers of config (the target's EngineConfig), with a paged pool of
    spec.draft_kv_tokens tokens (None: the tokens the target's pool holds) in the target's
    block size, context and batch, config's threads, KV type and attention."""
    model = Model(spec.draft_model, n_gpu_layers=config.n_gpu_layers, main_gpu=config.main_gpu)
    try:
        if model.config.is_encoder:
            raise PagedError(f"draft model {model.path} is an embedding model: it cannot draft tokens")
        if model.config.is_hybrid:   # its drafts would pass through a recurrent state with no rollback
            raise PagedError(f"draft model {model.path} is a hybrid (Gated DeltaNet layers): it cannot draft "
                             "tokens yet")
        check_same_vocab(model, target)
        tokens = spec.draft_kv_tokens
        if tokens is None:   # as many tokens as the target's pool, whatever their bytes
            tokens = max(1, target_runner.kv_pool_bytes // target_runner.kv_bytes_per_token)
        block_size = target_runner.kv.block_size if target_runner.kv.paged else 32
        kv_bytes = tokens * dense_kv_bytes_per_token(model.config, config.kv_cache_type)
        return ModelRunner(model, dataclasses.replace(
            config, paged=True, n_ctx=target_runner.n_ctx, n_batch=target_runner.n_batch, block_size=block_size,
            num_blocks=None, kv_bytes=kv_bytes, free_window_blocks=True))
    except BaseException:
        model.close()
        raise


class DraftModelDrafter:
    """Greedy drafts from a draft model, batched across sequences (Speculator's drafter)."""

    def __init__(self, runner: ModelRunner, num_draft_tokens: int):
        self.runner = runner
        self.num_draft_tokens = num_draft_tokens
        # a lag up to this is what drafting every step leaves behind (the accepted tokens and
        # the target's own, plus a step skipped at a block's end): computed with the draft,
        # outside the catch-up budget, as the target's verification rows are
        self.free_lag = num_draft_tokens + 2
        self.forward_seconds = 0.0         # time in the draft model's forward steps
        self.num_forwards = 0
        self.catch_up_tokens = 0           # tokens computed under the catch-up budget, all steps
        self.last_catch_up_tokens = 0      # of those, in the latest propose_many
        self.lagging: set[int] = set()     # target seq ids left behind by the latest propose_many
        self._seqs: dict[int, SeqState] = {}   # target seq id -> its draft sequence

    # ---- draft sequences ---------------------------------------------------
    def retain(self, seq_ids) -> None:
        """Free the draft sequences of every target sequence not in seq_ids."""
        self.release([seq_id for seq_id in self._seqs if seq_id not in seq_ids])

    def release(self, seq_ids) -> None:
        """Free the draft sequences of these target sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            self.lagging.discard(seq_id)
            state = self._seqs.pop(seq_id, None)
            if state is not None:
                self.runner.free(state)

    @property
    def num_sequences(self) -> int:
        """Draft sequences held."""
        return len(self._seqs)

    def lag(self, seq_id: int, token_ids) -> int:
        """Tokens of token_ids seq_id's draft sequence has not computed (all of them without one)."""
        state = self._seqs.get(seq_id)
        return len(token_ids) - (state.num_computed if state is not None else 0)

    def _state(self, seq_id: int, token_ids) -> SeqState:
        """seq_id's draft sequence, started from the draft pool's prefix cache if new."""
        state = self._seqs.get(seq_id)
        if state is not None and state.num_computed >= len(token_ids):
            # nothing new to compute gives no logits row: start over (the prefix cache keeps it cheap)
            self.release([seq_id])
            state = None
        if state is None:
            state = self.runner.add_sequence_cached(token_ids)
            self._seqs[seq_id] = state
        return state

    def _place(self, state: SeqState, token_ids, n: int) -> bool:
        """Place token_ids up to state's next n to compute; False when the draft pool has no room."""
        try:
            self.runner.copy_blocks(place_tokens(self.runner.kv, state, token_ids[state.num_tokens:
                                                                                   state.num_computed + n]))
        except OutOfBlocksError:
            return False
        return True

    # ---- drafting ----------------------------------------------------------
    def propose_many(self, wants, catch_up_budget: int | None = None) -> list[list[int]]:
        """Greedy drafts for [(seq id, token ids, most tokens)], one list each. A sequence
        lagging more than free_lag tokens is caught up with at most catch_up_budget tokens
        in all (None: unbounded), in want order, and drafts only once the piece reaches its
        newest token."""
        drafts: list[list[int]] = [[] for _ in wants]
        budget = float("inf") if catch_up_budget is None else max(0, catch_up_budget)
        work = []   # (index in wants or None for a catch-up piece, draft sequence, tokens to draft)
        charged = 0
        self.lagging = set()
        for at, (seq_id, token_ids, k) in enumerate(wants):
            try:
                state = self._state(seq_id, token_ids)
            except OutOfBlocksError:   # the draft pool is full: this sequence drafts nothing this step
                self.lagging.add(seq_id)
                continue
            lag = len(token_ids) - state.num_computed
            n = lag if lag <= self.free_lag else int(min(lag, budget - charged))
            if n <= 0 or not self._place(state, token_ids, n):
                self.lagging.add(seq_id)
                continue
            if lag > self.free_lag:
                charged += n
            if n < lag:   # a piece: computed now, no draft until the rest is
                self.lagging.add(seq_id)
                work.append((None, state, 0))
                continue
            # tokens after the first run at the slots after the newest placed one, in its block
            k = min(k, self.num_draft_tokens, 1 + block_room(state.num_tokens - 1, self.runner.kv.block_size))
            work.append((at, state, k))
        self.last_catch_up_tokens = charged
        self.catch_up_tokens += charged
        if not work:
            return drafts
        started = time.perf_counter()
        first = self._catch_up([state for _, state, _ in work])
        live = [(at, state, k) for at, state, k in work if at is not None]
        for (at, _, _), token in zip(work, first):
            if at is not None:
                drafts[at].append(token)
        if live:
            self._extend(live, drafts)
        self.forward_seconds += time.perf_counter() - started
        return drafts

    def _catch_up(self, states: list[SeqState]) -> list[int]:
        """Compute every placed, uncomputed token of states in n_batch-sized batched
        steps; returns each state's argmax after its last placed token."""
        firsts: dict[int, int] = {}
        n_batch = self.runner.n_batch
        while len(firsts) < len(states):
            work, room = [], n_batch
            for i, state in enumerate(states):
                pending = state.num_tokens - state.num_computed
                if i in firsts or room <= 0 or pending <= 0:
                    continue
                n = min(pending, room)
                work.append((i, state, n))
                room -= n
            if not work:   # every state was caught up with at least one token placed: unreachable
                raise PagedError("draft catch-up: a draft sequence has nothing to compute")
            logits = self.runner.step([(state, n) for _, state, n in work])
            self.num_forwards += 1
            # a logits row comes back for each item that reached its last placed token, in item order
            done = [i for i, state, _ in work if state.num_computed == state.num_tokens]
            for i, token in zip(done, np.argmax(logits, axis=1).tolist()):
                firsts[i] = token
        return [firsts[i] for i in range(len(states))]

    def _extend(self, live, drafts: list[list[int]]) -> None:
        """Run greedy draft steps for every live sequence wanting more tokens, each draft
        token at the position and slot after the previous one (never placed)."""
        pos, slots, tables = self._newest_token_arrays([state for _, state, _ in live])
        wants = np.array([k for _, _, k in live])
        for j in range(1, int(wants.max())):
            active = np.flatnonzero(wants > j)
            tokens = [drafts[live[i][0]][-1] for i in active]
            logits = self.runner.forward(tokens, pos[active] + j, (slots[:, active] + j).reshape(-1),
                                         np.arange(len(active)), tables[:, active], np.arange(len(active)))
            self.num_forwards += 1
            for i, token in zip(active, np.argmax(logits, axis=1).tolist()):
                drafts[live[i][0]].append(token)

    def _newest_token_arrays(self, states: list[SeqState]):
        """(positions [n], slots [n_groups, n], block tables [n_groups, n, max blocks]) of each
        state's newest placed token, read from its block tables. Not a step's batch: the pool
        would refuse to recompute that token once a sliding-window group has given back a
        block its query saw, and no query here needs that block (drafts attend from later)."""
        kv = self.runner.kv
        bs, n = kv.block_size, len(states)
        pos = np.array([state.num_tokens - 1 for state in states], dtype=np.int32)
        tables = np.full((kv.n_groups, n, kv.max_blocks_per_seq), -1, dtype=np.int32)
        slots = np.empty((kv.n_groups, n), dtype=np.int32)
        for i, state in enumerate(states):
            for g in range(kv.n_groups):
                table = kv.block_table(state.handle, g)
                tables[g, i, :len(table)] = table
                slots[g, i] = table[pos[i] // bs] * bs + pos[i] % bs
        return pos, slots, tables

    def close(self) -> None:
        """Free every draft sequence, the draft runner and its model."""
        model = self.runner.model
        self._seqs.clear()   # the pool goes with the runner
        self.lagging.clear()
        self.runner.close()
        model.close()

    def stats(self) -> dict:
        """The draft model's counters for LLMEngine.stats()."""
        kv = self.runner.kv
        pool = kv.pool.stats()
        return {"spec_draft_forward_seconds": self.forward_seconds, "spec_draft_forwards": self.num_forwards,
                "spec_draft_catch_up_tokens": self.catch_up_tokens, "spec_draft_lagging": len(self.lagging),
                "spec_draft_sequences": len(self._seqs), "spec_draft_blocks_used": pool.num_used,
                "spec_draft_blocks_total": pool.num_blocks}


def drafter_for(spec: SpeculativeConfig, target: Model, target_runner: ModelRunner, config):
    """The drafter spec asks for: a DraftModelDrafter for method draft_model, else None
    (Speculator's default, prompt lookup). config: the target's EngineConfig."""
    if spec.method != "draft_model":
        return None
    return DraftModelDrafter(load_draft_runner(spec, target, target_runner, config), spec.num_draft_tokens)
