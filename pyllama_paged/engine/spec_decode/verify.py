"""Speculative decoding in the engine's step: which decodes get a draft, and the
verdict on each draft from the target's logits rows.

Verification is the standard rejection rule for a deterministic draft (q puts all
its mass on the drafted token x): accept x with probability p(x), else draw from p
with x removed and renormalised; after k acceptances draw a bonus token from the
last row. Drawing y ~ p with the sequence's own sampler and accepting iff y == x is
exactly that rule: P(accept) = p(x), and a rejected draw is distributed as
p(y) / (1 - p(x)) over y != x. So each row is drawn by the batched native sampler
with every rule of the request (temperature, top-k/top-p/min-p, penalties over the
tokens so far, logit_bias, logits processor, grammar mask), the output distribution
is the target's at any temperature, greedy accepts while the argmax matches, and
each emitted token costs one draw as without speculation (a seeded request draws
the same tokens up to float near-ties). Rows are drawn in rounds (row j of every
live draft per call) because row j's grammar mask and penalty history depend on
the tokens accepted before it; the grammar advances only over emitted tokens.
A draft model drafting greedily (argmax, draft_model.py) is a deterministic
draft too, so the same rule stays exact for it.

Accepted draft tokens are placed in the pool after the step (their K/V are already
in the right slots, worker/draft_splice.py) and committed then: only then can a block they fill
become a prefix-cache entry. A hybrid model's (Qwen3.5/3.6) recurrent state has taken every
drafted token by then: its state before the step is kept (HybridKV.hold_state) and, when a
draft token is rejected, put back, the accepted tokens then recomputed (_roll_back)."""

from __future__ import annotations

import numpy as np

from ..kv.manager import place_tokens
from ..worker.draft_splice import block_room
from .draft import PromptLookupDrafter, SpeculativeConfig
from .length import DraftLengths


class Speculator:
    """One engine's drafter and its counters."""

    def __init__(self, config: SpeculativeConfig, drafter=None):
        self.config = config
        # drafter: prompt lookup unless given (draft_model.DraftModelDrafter)
        self.drafter = drafter if drafter is not None else PromptLookupDrafter(config)
        self.lengths = DraftLengths(config.draft_token_cost)   # how many tokens pay, per sequence
        self.num_draft_tokens = 0       # tokens proposed and verified
        self.num_accepted_tokens = 0    # of those, emitted as drafted
        self.num_drafts = 0             # (sequence, step) pairs that carried a draft

    @staticmethod
    def applies(request) -> bool:
        """Whether a request speculates: sampled (not beams), not opted out."""
        return not request.is_beam and getattr(request.params, "speculative", True) is not False

    def draft(self, output, seqs: dict, requests: list, kv, n_batch: int,
              catch_up_budget: int | None = None) -> dict[int, list[int]]:
        """Drafts for the step's decode items: {item index: tokens}. A draft stays in the
        block of its sequence's newest token, within the step's n_batch and the request's
        max_len (the step emits at most draft + 1 tokens).
        catch_up_budget: the tokens a draft model may compute this step to catch up
        sequences it lags behind (the step's spare prefill budget; None: no bound)."""
        room = n_batch - sum(output.num_tokens)
        # a drafter's per-sequence state (a draft model's KV) goes with preempted and ended sequences
        self.drafter.retain({seq_id for seq_id, seq in seqs.items() if seq.kv is not None and not seq.is_finished})
        wanted: list[tuple[int, int]] = []   # (item index, most tokens)
        for i in range(output.num_decodes):
            if room <= 0:
                break
            seq_id, request = output.seq_ids[i], requests[i]
            if not self.applies(request):
                continue
            _, start, n = output.items[i]
            last = start + n - 1            # the newest token's position
            # the step emits up to k + 1 tokens after it: all must fit the request's max_len
            k = min(room, block_room(last, kv.block_size), request.max_len - 2 - last)
            k = self.lengths.length(seq_id, k) if k > 0 else 0
            if k <= 0:
                continue
            wanted.append((i, k))
            room -= k   # reserved whole: drafts are proposed together (a draft model batches them)
        proposed = self.drafter.propose_many([(output.seq_ids[i], seqs[output.seq_ids[i]].token_ids, k)
                                              for i, k in wanted], catch_up_budget)
        drafts = {i: tokens for (i, _), tokens in zip(wanted, proposed) if tokens}
        if hasattr(kv, "hold_state"):   # a hybrid: the state before the draft, for a rejection
            for i in drafts:
                kv.hold_state(int(output.items[i][0]))
        return drafts

    @property
    def last_catch_up_tokens(self) -> int:
        """Tokens the drafter computed under the catch-up budget in the latest draft()."""
        return self.drafter.last_catch_up_tokens

    def forget(self, seqs) -> None:
        """An ended request's sequences: the drafter frees what it holds for them."""
        self.drafter.release([seq.seq_id for seq in seqs])
        self.lengths.forget([seq.seq_id for seq in seqs])

    def close(self) -> None:
        """Free the drafter (a draft model and its KV pool)."""
        self.drafter.close()

    def verify(self, sampler, logits: np.ndarray, items: list, accept, fail, is_live, kv, copy_blocks) -> None:
        """Emit each drafted sequence's tokens from its rows. items: (request, seq, first
        logits row, draft) per sequence. accept(request, seq, sampled) appends one token
        (and may finish the sequence); fail(request, error) ends a request; is_live(request)
        says whether it still runs. Accepted draft tokens are then placed and committed."""
        state = [[request, seq, row, draft, 0] for request, seq, row, draft in items]   # last: accepted
        live = list(state)
        j = 0
        while live:
            picks = [(row + j, seq.sampler, seq.token_ids) for _, seq, row, _, _ in live]
            drawn = sampler.sample(logits, picks)
            still = []
            for entry, sampled in zip(live, drawn):
                request, seq, _, draft, _ = entry
                if not is_live(request):
                    continue
                if sampled.error:
                    fail(request, sampled.error)
                    continue
                matched = j < len(draft) and sampled.token == draft[j]
                accept(request, seq, sampled)
                if matched:
                    entry[4] += 1
                    if not seq.is_finished:
                        still.append(entry)
            live = still
            j += 1
        hybrid = hasattr(kv, "roll_back_state")
        for request, seq, _, draft, accepted in state:
            self.num_drafts += 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += accepted
            self.lengths.observe(seq.seq_id, len(draft), accepted)
            going_on = not seq.is_finished and is_live(request) and seq.kv is not None
            if hybrid and going_on and accepted < len(draft):
                self._roll_back(kv, seq)
                continue
            if hybrid and seq.kv is not None:
                kv.release_state(seq.kv.handle)
            if accepted and going_on:
                self._commit(kv, seq, draft[:accepted], copy_blocks)

    @staticmethod
    def _roll_back(kv, seq) -> None:
        """A hybrid's rejected draft tokens went through its recurrent state, which has no
        undo: the state goes back to before the step, and the step's newest token and the
        accepted ones are computed again, the next step's prefill chunk that ends in the
        token the verdict drew. Their rows' logits were right (causal), only the state after
        them was not."""
        kv.roll_back_state(seq.kv.handle)
        seq.kv.num_computed -= 1

    @staticmethod
    def _commit(kv, seq, tokens: list[int], copy_blocks) -> None:
        """Place accepted draft tokens (their K/V written by the step) and mark them
        computed: full blocks become prefix-cache entries only now."""
        start = seq.kv.num_computed
        # within the newest token's block, which the sequence holds alone: no copy is
        # expected; one made anyway carries the drafts' K/V along with the block
        copy_blocks(place_tokens(kv, seq.kv, tokens))
        seq.kv.num_computed = start + len(tokens)
        kv.commit_batch(np.array([[seq.kv.handle, start, len(tokens)]], dtype=np.int32))

    def stats(self) -> dict:
        """Counters for LLMEngine.stats()."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"spec_draft_tokens": self.num_draft_tokens, "spec_accepted_tokens": self.num_accepted_tokens,
                "spec_drafts": self.num_drafts, "spec_acceptance_rate": rate, **self.drafter.stats()}
