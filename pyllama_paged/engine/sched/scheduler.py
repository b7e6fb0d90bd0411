"""Continuous-batching scheduler: waiting / running / swapped queues, FCFS
admission under a block watermark, chunked prefill under a per-step token
budget, and whole-request preemption by recompute or swap.

The scheduler keeps the books (which pages each sequence holds, through the
KV manager) and returns the step as plain data (SchedulerOutput: sequence
ids, token counts, block ids to swap and copy). It never touches KV data or
the model: the engine carries the moves out and runs the model, then hands
the output back to update_from_output, which advances every sequence's
computed tokens (the one place progress is written).

A prompt's tokens are placed in the KV pool chunk by chunk, as they are
scheduled (after the prefix cache's hits): a long prompt never holds pages
for tokens it has not reached, and sliding-window groups give pages back as
the chunks move past their window."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..kv.manager import SeqState, fork_state, new_cached_sequence, place_decodes, place_tokens
from .preemption import PREEMPTION_MODES, release, swap_in, swap_out
from .step_cost import StepCostModel
from .scheduler_output import SchedulerOutput, TierLoad
from ...errors import OutOfBlocksError
from ...flags import at_least_zero, flagged
from .request import Request, RequestStatus, Sequence

# "auto" budget: a running stream may slow to this many times a lone stream's
# pace while others share the step.
ITL_AUTO_FACTOR = 4.0


def itl_budget_option(text: str) -> float | str | None:
    """--itl-budget-ms's text as SchedulerConfig.itl_budget: 'auto', 'off' (or 0) for None,
    else milliseconds as seconds."""
    if text == "auto":
        return "auto"
    if text == "off":
        return None
    ms = at_least_zero(text, float, "'auto', 'off' or milliseconds")
    return ms / 1000 if ms > 0 else None


def _budget_text(budget: float | str | None) -> str:
    return "off" if budget is None else budget if isinstance(budget, str) else f"{budget * 1000:g}"


@dataclass
class SchedulerConfig:
    """How one engine's scheduler admits, chunks and preempts; a flagged field is an option of `serve`."""

    max_num_batched_tokens: int = 512   # tokens computed per step (decodes + prefill chunks)
    max_num_seqs: int = flagged(64, "--max-seqs", "sequences running at once, per model", type=int)
    watermark: float = 0.01             # fraction of blocks admission leaves free
    # recompute: cheaper on CPU (no copy traffic); swap: keeps work
    preemption_mode: str = flagged("recompute", "--preemption", "what a preempted request loses: recompute its KV "
                                   "later, or swap it to host memory", choices=PREEMPTION_MODES)
    # Prefill tokens a step may add while decodes run: bounds every running
    # stream's inter-token gap when new users arrive, at the cost of their
    # time to first token (a long prompt takes several steps). None: up to
    # max_num_batched_tokens, as steps without decodes (throughput first).
    max_prefill_tokens_with_decodes: int | None = None
    # The inter-token budget of running streams, in seconds: while sequences
    # decode, waiting requests are admitted, and prefill chunks sized, only as
    # far as the next step is predicted (StepCostModel, learned from the steps
    # run) to take at most this long. "auto": ITL_AUTO_FACTOR times a
    # one-sequence decode step on this machine. None: no budget (throughput
    # first, for offline batches).
    itl_budget: float | str | None = flagged(
        None, "--itl-budget-ms", "inter-token budget of running streams: new users are admitted (and prompts "
        "prefilled) only as far as every stream keeps this gap; 'auto' = 4x a lone stream's step on this machine, "
        "'off' = throughput first", type=itl_budget_option, show=_budget_text,
        metavar="ITL_BUDGET_MS")
    min_prefill_tokens_with_decodes: int = 16   # waiting users progress even at the budget
    # Tokens of a step that running prefills leave to admitting waiting requests: a long
    # prompt prefilling alone would otherwise take whole steps until it is done, and a short
    # request arriving meanwhile (the next turn of a running chat) would wait for all of it.
    admission_reserve_tokens: int = 64
    # Host memory that swapped-out KV may hold (vLLM's swap_space); a preemption that
    # would pass it recomputes instead, so swapping never grows the process unbounded.
    swap_space_bytes: int = 4 << 30


@dataclass
class _StepState:
    """What the phases of one schedule() share: the token budget left, the inter-token
    budget in force, whether a request was preempted, whether a prefill starved."""

    budget: int
    itl_budget: float | None = None
    preempted: bool = False
    starved: bool = False


def _chunk_budget(request: Request, budget: int) -> int:
    """The tokens request may compute this step out of the step's budget left."""
    cap = request.max_chunk_tokens
    return budget if cap is None else min(cap, budget)


class Scheduler:
    """Decides which sequences compute how many tokens in the next step."""

    def __init__(self, kv, n_ctx: int, config: SchedulerConfig | None = None, block_bytes: int = 0):
        self.kv = kv          # the KV manager (PagedKV or SlabKV): the books, never the data
        self.n_ctx = n_ctx
        self.block_bytes = block_bytes   # one block's K and V in all layers: a swapped block's host copy
        self.swapped_bytes = 0           # host bytes held by swapped-out requests
        self.config = config or SchedulerConfig()
        if self.config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.reserve_blocks = math.ceil(self.config.watermark * kv.num_blocks) if kv.paged else 0
        self._plan = SchedulerOutput()   # the step being decided
        self.num_preemptions = 0
        self.num_swaps = 0                # preemptions by swap (the others recomputed)
        # prompt tokens looked up in the prefix cache at admission, and those found (vLLM's
        # prefix_cache_queries and prefix_cache_hits, in tokens)
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.tiers = None                 # a PrefixTiers below the pool (the engine sets it), or None
        self.tier_hit_tokens = 0          # prompt tokens restored from a tier at admission
        budget = self.config.itl_budget
        if not (budget is None or budget == "auto" or (isinstance(budget, (int, float)) and budget > 0)):
            raise ValueError(f"itl_budget must be a number of seconds > 0, 'auto' or None, got {budget!r}")
        # a hybrid's sequences each hold a recurrent state slot (kv.states): no more run at once
        # than it keeps for sequences (the others hold prefix-cache checkpoints)
        self.state_slots = getattr(kv, "running_slots", None)
        # a hybrid's prefill chunks stop where a state checkpoint is worth saving
        self._aligned_chunk = kv.aligned_chunk if getattr(kv, "checkpoints_on", False) else None
        self.step_cost = StepCostModel()
        self._last_shape = (0, 0)   # (decode tokens, prefill tokens) of the step last scheduled
        # prefill tokens the step last scheduled could still have taken (its token budget and,
        # while decodes run, its inter-token budget): a draft model's catch-up spends them
        self.spare_prefill_tokens = 0

    # ---- queue management ------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request, or finish it at once with an error if it can never fit."""
        n = len(request.prompt_ids)
        limit = min(self.n_ctx, self.kv.capacity_tokens())
        if n == 0:
            request.error = "the prompt is empty"
        elif n >= limit:
            pool = self.kv.capacity_tokens()
            request.error = (f"prompt of {n} tokens does not fit the context of {self.n_ctx} tokens"
                             + (f" (the KV pool holds {pool} per sequence)" if pool < self.n_ctx else ""))
        elif self.state_slots is not None and self._width(request, []) > self.state_slots:
            request.error = (f"the request runs {self._width(request, [])} sequences at once, more than the "
                             f"{self.state_slots} recurrent state slots this hybrid model's engine holds "
                             "(raise n_seq_max or the KV budget)")
        if request.error:
            request.status = RequestStatus.FINISHED
            return
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _width(self, request: Request, seqs) -> int:
        """Sequences of a request holding seqs now: an n>1 or beam request that has not
        forked yet counts at the width it forks to right after its prefill. With state slots,
        a beam search counts the 2 x width - 1 sequences it holds while it forks new beams
        before pruning old ones."""
        width = max(len(seqs), 1 if request.is_forked else max(request.params.n, request.params.beam_width))
        if self.state_slots is not None and request.is_beam:
            width = max(width, 2 * request.params.beam_width - 1)
        return width

    @property
    def max_num_seqs(self) -> int:
        """Sequences that may run at once: the configured limit, and a hybrid's state slots."""
        if self.state_slots is None:
            return self.config.max_num_seqs
        return min(self.config.max_num_seqs, self.state_slots)

    def num_running_seqs(self) -> int:
        """Running sequences, counting a request that will still fork at its full width."""
        return sum(self._width(r, r.live_seqs) for r in self.running)

    def remove(self, request: Request) -> None:
        """Drop a request from its queue and free its KV (abort or finish)."""
        queue = {RequestStatus.WAITING: self.waiting, RequestStatus.SWAPPED: self.swapped,
                 RequestStatus.RUNNING: self.running}.get(request.status)
        if queue is not None:
            try:
                queue.remove(request)
            except ValueError:
                pass   # failed before it was queued
        for seq in request.seqs + request.finished_beams:
            release(self.kv, seq)
        self._release_swap_space(request)
        request.status = RequestStatus.FINISHED

    # ---- preemption (the moving is in preemption.py) -----------------------
    def _preempt(self, request: Request) -> None:
        """Take every block of a running request at once (recompute or swap)."""
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        # a hybrid recomputes: its recurrent state is not copied out with the pages (swap's
        # host copies hold KV only), and a request started over needs only its slot back
        swap = self.config.preemption_mode == "swap" and self.state_slots is None
        host_bytes = self._swap_bytes(request) if swap else None
        if host_bytes is not None and self.swapped_bytes + host_bytes <= self.config.swap_space_bytes:
            for seq in request.live_seqs:
                self._plan.swap_out += swap_out(self.kv, seq)
            request.swapped_bytes = host_bytes
            self.swapped_bytes += host_bytes
            self.num_swaps += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
        else:   # recompute (also when the swap space is full)
            for seq in request.seqs:
                release(self.kv, seq)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _swap_bytes(self, request: Request) -> int:
        """Host bytes a swap-out of request would take: one copy per block it holds."""
        kv = self.kv
        return self.block_bytes * sum(int((kv.block_table(seq.kv.handle, g) >= 0).sum())
                                      for seq in request.live_seqs if seq.kv is not None
                                      for g in range(kv.n_groups))

    def _release_swap_space(self, request: Request) -> None:
        self.swapped_bytes -= request.swapped_bytes
        request.swapped_bytes = 0

    def _place(self, seq: Sequence, token_ids) -> None:
        """Place tokens of seq in the pool; the copy-on-write copies join the plan."""
        self._plan.block_copies += place_tokens(self.kv, seq.kv, token_ids)

    def _add_chunk(self, seq: Sequence, num_tokens: int) -> None:
        """seq computes its next num_tokens tokens this step (they are placed already)."""
        self._plan.add_chunk(seq.seq_id, seq.kv.handle, seq.kv.num_computed, num_tokens)

    def _fail(self, request: Request) -> None:
        """End a request with the error already set on it; the engine reports it."""
        self.remove(request)
        self._plan.failed_request_ids.append(request.request_id)

    def _blocks_for(self, seqs: list[Sequence], blocks_of) -> bool:
        kv = self.kv
        if not kv.paged:
            return kv.num_blocks - kv.num_in_use >= len(seqs)
        need = sum(blocks_of(s) for s in seqs)
        # the reserve keeps room for running sequences to grow; with none running it is not needed
        return need + (self.reserve_blocks if self.running else 0) <= kv.pool.num_allocatable

    def _place_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq's pending prefill to compute this step, placed in the pool first
        (halved until their pages fit, keeping the reserve while others run); 0 if none fit."""
        kv = self.kv
        n = min(len(seq.token_ids) - seq.kv.num_computed, budget)
        if self._aligned_chunk is not None:
            n = self._aligned_chunk(seq.kv.num_computed, n, len(seq.token_ids), seq.kv.handle)
        reserve = self.reserve_blocks if len(self.running) > 1 else 0
        while n > 0:
            place = seq.kv.num_computed + n - seq.kv.num_tokens
            if place <= 0 or kv.blocks_needed(seq.kv.handle, place) + reserve <= kv.num_allocatable:
                break
            n //= 2
        if n > 0 and place > 0:
            self._place(seq, seq.token_ids[seq.kv.num_tokens:seq.kv.num_computed + n])
        return n

    # ---- the inter-token budget ------------------------------------------------
    def itl_budget_seconds(self) -> float | None:
        """The step-time budget in force now (None: none, or "auto" still learning)."""
        budget = self.config.itl_budget
        if budget is None:
            return None
        if budget == "auto":
            if not self.step_cost.ready:
                return None
            return ITL_AUTO_FACTOR * self.step_cost.predict(1)
        return float(budget)

    def observe_step(self, seconds: float) -> None:
        """The engine's report of how long the step last scheduled took."""
        self.step_cost.observe(*self._last_shape, seconds)

    # ---- after the step ------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """The step of output ran: each chunk's tokens are computed (the pool marks them, and
        its full blocks become prefix-cache hits). seqs: the step's sequences by id."""
        for seq_id, (_, start, n) in zip(output.seq_ids, output.items):
            state = seqs[seq_id].kv
            assert state.num_computed == start, "a sequence moved between schedule and update"
            state.num_computed = start + n
        if output.items:
            self.kv.commit_batch(output.items_array())

    def free_sequence(self, seq: Sequence) -> None:
        """A finished (or pruned) sequence gives its pages back at once."""
        release(self.kv, seq)

    def fork_sequence(self, seq: Sequence) -> SeqState:
        """KV for a new sequence sharing every page of seq (n>1 samples, beams)."""
        return fork_state(self.kv, seq.kv)

    # ---- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step: which sequences compute how many tokens, and the KV data moves
        the engine must make first. Its phases, in order: decodes, prefill chunks of
        running requests, swapped requests back, waiting ones admitted, and a way out
        when nothing can move."""
        self._plan = plan = SchedulerOutput()
        step = _StepState(budget=self.config.max_num_batched_tokens)
        self._schedule_decodes(step)
        plan.num_decodes = len(plan.seq_ids)
        step.itl_budget = self.itl_budget_seconds()
        self._cap_prefill(step)
        reserve = self._admission_reserve(step)
        step.budget -= reserve
        self._schedule_running_prefills(step)
        step.budget += reserve
        if not step.preempted:
            self._resume_swapped()
            if not self._admit_waiting(step):
                return self._planned(step)
        if not plan.seq_ids and not step.preempted:
            self._unstick(step.starved)
        return self._planned(step)

    def _planned(self, step: _StepState) -> SchedulerOutput:
        """The plan, with the step's shape and spare prefill budget noted."""
        plan = self._plan
        self._last_shape = (plan.num_decodes, plan.num_prefill_tokens)
        self.spare_prefill_tokens = max(0, step.budget) if plan.seq_ids else 0
        return plan

    def charge_prefill(self, num_tokens: int) -> None:
        """Prefill-like tokens the engine computed in the step last scheduled outside its
        plan (a draft model catching up): the step's cost model learns them as prefill."""
        if num_tokens > 0:
            decodes, prefill = self._last_shape
            self._last_shape = (decodes, prefill + num_tokens)

    def _schedule_decodes(self, step: "_StepState") -> None:
        """Decodes first: every running sequence whose prefill is done gets its newest
        token's slot, preempting the latest arrival when blocks run out. A request's
        sequences (n>1, beams) get their slots together or not at all: capacity is
        checked for all of them before any is appended."""
        self.running.sort(key=lambda r: r.arrival)
        if self._place_all_decodes(step):
            return
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue   # preempted while making room for an earlier request
            appends = []
            for seq in request.live_seqs:
                # a decode: its one new token (a prompt still being placed is a prefill)
                if seq.kv is None or seq.kv.num_computed < seq.kv.num_tokens or step.budget <= 0 or \
                        len(seq.token_ids) - seq.kv.num_tokens != 1:
                    continue
                new = seq.token_ids[seq.kv.num_tokens:]
                appends.append((seq, new))
                step.budget -= len(new)
            if appends and self._make_room(request, appends, step):
                for seq, new in appends:
                    self._place(seq, new)
                    self._add_chunk(seq, len(new))
            elif appends:
                step.budget += sum(len(new) for _, new in appends)

    def _place_all_decodes(self, step: "_StepState") -> bool:
        """Every running decode placed in one native call, when the budget and the pool take
        them all (no preemption to decide, the common step): True if so; else nothing changed."""
        budget, picked = step.budget, []
        for request in self.running:
            if request.status != RequestStatus.RUNNING:
                return False
            for seq in request.live_seqs:
                if seq.kv is None or seq.kv.num_computed < seq.kv.num_tokens or \
                        len(seq.token_ids) - seq.kv.num_tokens != 1:
                    continue
                if budget <= 0:
                    return False
                picked.append(seq)
                budget -= 1
        if not picked:
            return False
        copies = place_decodes(self.kv, [s.kv for s in picked], [s.token_ids[-1] for s in picked])
        if copies is None:
            return False
        self._plan.block_copies += copies
        for seq in picked:
            self._add_chunk(seq, 1)
        step.budget = budget
        return True

    def _make_room(self, request: Request, appends, step: "_StepState") -> bool:
        """Preempt the latest arrivals until request's appends fit; False if request itself
        was preempted, or failed because the pool cannot hold it even alone."""
        while not self.kv.can_append_all([(seq.kv.handle, len(new)) for seq, new in appends]):
            victim = self.running[-1]
            if len(self.running) == 1:
                # nothing left to take blocks from: the pool cannot hold it
                request.error = ("out of KV blocks: the request alone needs more pages "
                                 "than the pool holds")
                self._fail(request)
                break
            step.preempted = True
            self._preempt(victim)
            if victim is request:
                break
        return request.status == RequestStatus.RUNNING

    def _cap_prefill(self, step: "_StepState") -> None:
        """While decodes run, prefill may add only so many tokens: the configured cap, and
        what keeps the predicted step within the inter-token budget."""
        if not self._plan.seq_ids:
            return
        cap = self.config.max_prefill_tokens_with_decodes or step.budget
        if step.itl_budget is not None:
            cap = min(cap, max(self.config.min_prefill_tokens_with_decodes,
                               self.step_cost.prefill_tokens_within(self._plan.num_decodes, step.itl_budget)))
        step.budget = min(step.budget, cap)

    def _admission_reserve(self, step: "_StepState") -> int:
        """The part of the step's budget kept from running prefills for a waiting request
        that could be admitted now (0 when none waits or no sequence place is free)."""
        if not self.waiting or self.num_running_seqs() >= self.max_num_seqs:
            return 0
        return max(0, min(self.config.admission_reserve_tokens, step.budget // 2))

    def _schedule_running_prefills(self, step: "_StepState") -> None:
        """Next prefill chunks of running requests still prefilling."""
        decoding = set(self._plan.seq_ids)
        for request in self.running:
            for seq in request.live_seqs:
                pending = len(seq.token_ids) - seq.kv.num_computed if seq.kv else 0
                if pending > 0 and step.budget > 0 and seq.seq_id not in decoding:
                    n = self._place_chunk(seq, _chunk_budget(request, step.budget))
                    step.starved |= n == 0
                    if n > 0:
                        self._add_chunk(seq, n)
                        step.budget -= n

    def _resume_swapped(self) -> None:
        """Swapped requests come back before new ones (FCFS) while the pool holds them."""
        kv = self.kv
        while self.swapped:
            request = self.swapped[0]
            seqs = request.live_seqs
            if not self._blocks_for(seqs, lambda s: -(-len(s.swapped_tokens) // kv.block_size) * kv.n_groups):
                break
            self.swapped.popleft()
            self._release_swap_space(request)
            for seq in seqs:
                self._plan.swap_in += swap_in(kv, seq, request.lora)
                self._plan.resumed_seq_ids.append(seq.seq_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _admit_waiting(self, step: "_StepState") -> bool:
        """Admit waiting requests first-come-first-served while blocks, the sequence limit
        and the inter-token budget allow, with their first prefill chunks. False if an
        admission raced the pool (the request waits again; the plan is final)."""
        running_seqs = self.num_running_seqs()
        while self.waiting and step.budget > 0:
            request = self.waiting[0]
            seqs = request.live_seqs or request.seqs
            width = self._width(request, seqs)
            if running_seqs + width > self.max_num_seqs and self.running:
                break
            if step.itl_budget is not None and self.running and \
                    self.step_cost.predict(running_seqs + width) > step.itl_budget:
                break   # one more stream would slow every running one past the budget
            chunk = max(step.budget, self.kv.block_size)
            if not self._blocks_for(seqs, lambda s: self.kv.blocks_to_prefill(len(s.token_ids), chunk)):
                break
            self.waiting.popleft()
            for seq in seqs:
                try:
                    seq.kv = new_cached_sequence(self.kv, [] if request.is_prefill_only else seq.token_ids,
                                                 request.lora)
                except OutOfBlocksError:   # raced the watermark estimate: undo, retry later
                    for s in seqs:
                        release(self.kv, s)
                    self.waiting.appendleft(request)
                    return False
            if self.kv.paged and not request.is_prefill_only:
                self.prefix_queried_tokens += sum(len(s.token_ids) for s in seqs)
                self.prefix_hit_tokens += sum(s.kv.num_computed for s in seqs)
                if self.tiers is not None and request.lora is None:   # the tiers hold base-model KV
                    for seq in seqs:
                        self._restore_from_tiers(seq)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            running_seqs += width
            for seq in seqs:
                if len(seq.token_ids) - seq.kv.num_computed > 0 and step.budget > 0:
                    n = self._place_chunk(seq, _chunk_budget(request, step.budget))
                    if n > 0:
                        self._add_chunk(seq, n)
                        step.budget -= n
        return True

    def _restore_from_tiers(self, seq: Sequence) -> None:
        """Extend a new sequence's cached prefix with the blocks a lower tier holds: place
        them (a piece of at most a step's tokens at a time, as a prefill would, so that
        sliding-window groups give pages back between pieces), mark them computed, and
        plan the loads of their bytes (block ids and tier keys: the tiers pin the bytes,
        the engine writes them). Stops at the first block no tier holds, when the pool has
        no room (keeping the reserve), or one block before the prompt's end (its last
        token must be computed for logits)."""
        kv, tiers, bs = self.kv, self.tiers, self.kv.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        done = seq.kv.num_computed // bs
        if done >= max_blocks:
            return
        keys = tiers.keys(seq.token_ids, max_blocks)
        piece_blocks = max(1, self.config.max_num_batched_tokens // bs)
        reserve = self.reserve_blocks if self.running else 0
        while done < max_blocks:
            found = tiers.run_length(keys[done:done + piece_blocks])
            # room first, so that no block is read (and counted) only to be dropped
            if found == 0 or kv.blocks_needed(seq.kv.handle, (done + found) * bs - seq.kv.num_tokens) + reserve \
                    > kv.num_allocatable:
                return
            piece = []
            for key in keys[done:done + found]:
                if not tiers.pin(key):   # a file went bad or away since run_length
                    break
                piece.append(key)
            if not piece:
                return
            end = done + len(piece)
            self._place(seq, seq.token_ids[seq.kv.num_tokens:end * bs])
            tables = [kv.block_table(seq.kv.handle, g) for g in range(kv.n_groups)]
            for j, key in enumerate(piece):
                for g, table in enumerate(tables):
                    block = int(table[done + j])
                    if block >= 0:   # a window group that never held it gives it back anyway
                        self._plan.tier_loads.append(TierLoad(block, key, g))
            kv.mark_computed(seq.kv.handle, end * bs)
            seq.kv.num_computed = end * bs
            self.tier_hit_tokens += len(piece) * bs
            if len(piece) < piece_blocks:
                return
            done = end

    def _unstick(self, starved: bool) -> None:
        """Nothing to compute this step. Prefills that hold pages but cannot place their
        next chunk: take the latest arrival's pages so the earlier ones finish. Nothing
        running and the next request still does not fit: no block will ever be freed for
        it (e.g. a preempted n>1 request whose samples now need their own prompt copies),
        so it ends with an error rather than wait forever; so does a request alone that
        cannot fit (both may happen in one step)."""
        if starved:
            victim = self.running[-1]
            if len(self.running) == 1:
                victim.error = (f"out of KV blocks: the request needs more pages than the pool of "
                                f"{self.kv.num_blocks} holds")
                self._fail(victim)
            else:
                self._preempt(victim)
        if not self.running:
            queue = self.swapped or self.waiting
            if queue:
                request = queue.popleft()
                request.error = ("out of KV blocks: the request's sequences need more pages together "
                                 f"than the pool of {self.kv.num_blocks} holds")
                self._fail(request)
