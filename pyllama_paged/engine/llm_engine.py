"""LLMEngine: one step = Scheduler.schedule() (plain data), the KV moves it asks
for, ModelRunner.execute() over the batch, Scheduler.update_from_output()
(progress), then sample, fork (n>1, beams) and finish sequences.
Single-threaded; EngineLoop runs it for many callers."""

from __future__ import annotations

import itertools
import time
import numpy as np

from .beam_search import advance_beams, expansion_sampler, ranked_beams
from .pooling.embedding import DecoderPooling, EmbedParams
from .config import EngineConfig
from .worker.devices import device_kv_budget
from .worker.model import Model
from .worker.model_runner import ModelRunner, dense_kv_bytes_per_token
from .outputs import RequestOutput, TokenEvent
from ..errors import PagedError, RequestError
from .worker.sampler import BatchSampler, Sampled, Sampler, SamplingParams
from .scoring import PromptScores, ScoreParams
from .sched.preemption import SwapSpace
from .kv.prefix_tiers import PrefixTierConfig, PrefixTiers, TierWriter, kv_identity, model_fingerprint
from .sched.scheduler import Scheduler, SchedulerConfig
from .sched.scheduler_output import SchedulerOutput
from .spec.verify import Speculator
from .spec.draft_model import drafter_for
from .sched.request import Request, RequestStatus, Sequence
from ..tokenizer.tokenizer import Tokenizer


class LLMEngine:
    """Requests in, token events out, one step at a time."""

    def __init__(self, runner: ModelRunner, eot_ids, config: SchedulerConfig | None = None):
        self.runner = runner
        self.eot_ids = frozenset(eot_ids)
        self.scheduler = Scheduler(runner.kv, runner.n_ctx, config, block_bytes=runner.block_bytes)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_computed_tokens = 0          # tokens run through the model
        self.num_generated_tokens = 0
        self.limit = min(runner.n_ctx, runner.kv.capacity_tokens())
        self.sampler = BatchSampler(runner.n_vocab, runner.n_threads)
        self.forward_seconds = 0.0            # time in the model step and in sampling, for /stats
        self.sample_seconds = 0.0
        self.step_seconds = 0.0               # whole steps (schedule to outputs)
        self.num_steps = 0
        self.pooling = DecoderPooling()       # embedding requests' pooled states in flight
        self.swap_space = SwapSpace()         # host copies of swapped-out pages
        self.scores = PromptScores()          # scoring requests' scores in flight
        self._owned_model = None              # a model from_config loaded (closed with the engine)
        self.speculator: Speculator | None = None   # speculative decoding (EngineConfig.speculative)
        self.tiers: PrefixTiers | None = None       # the prefix cache below the pool (use_prefix_tiers)

    @classmethod
    def from_config(cls, config: EngineConfig, *, model: Model | None = None, eot_ids=None) -> "LLMEngine":
        """The engine config describes: its model (loaded from config.model_path unless given;
        one loaded here is closed with the engine), KV pool, runner and scheduler. eot_ids:
        the ids that end generation (None: the GGUF tokenizer's)."""
        owned = model is None
        model = model or Model(config.model_path, repack_weights=config.repack_weights,
                               pack_panels=config.pack_panels, n_gpu_layers=config.n_gpu_layers,
                               main_gpu=config.main_gpu)
        try:
            n_ctx = config.context_for(model.config.n_ctx_train)
            budget = config.kv_budget_bytes(n_ctx, dense_kv_bytes_per_token(model.config, config.kv_cache_type))
            if model.device is not None and not config.kv_budget_given:
                budget = device_kv_budget(model, budget)
            if config.paged:
                sizes = dict(num_blocks=config.num_blocks, kv_bytes=budget)
            else:   # the baseline: the same bytes as whole n_ctx slabs
                dense_slab = n_ctx * dense_kv_bytes_per_token(model.config, config.kv_cache_type)
                sizes = dict(n_seq_max=max(1, budget // dense_slab))
            runner = ModelRunner(model, paged=config.paged, n_ctx=n_ctx, n_threads=config.n_threads,
                                 n_batch=config.n_batch, block_size=config.block_size,
                                 kv_cache_type=config.kv_cache_type, free_window_blocks=config.free_window_blocks,
                                 attention=config.attention, **sizes)
            if eot_ids is None:
                eot_ids = Tokenizer.from_metadata(model.metadata).eot_ids
        except BaseException:
            if owned:
                model.close()
            raise
        engine = cls(runner, eot_ids, config.scheduler)
        engine._owned_model = model if owned else None
        if config.speculative is not None:
            try:   # a draft model (method draft_model) loads here, checked against the target
                engine.speculator = Speculator(config.speculative, drafter_for(
                    config.speculative, model, runner, n_threads=config.n_threads,
                    kv_cache_type=config.kv_cache_type, attention=config.attention,
                    n_gpu_layers=config.n_gpu_layers, main_gpu=config.main_gpu))
            except BaseException:
                engine.close()
                raise
        if config.prefix_tiers is not None and config.prefix_tiers.enabled and config.paged:
            engine.use_prefix_tiers(config.prefix_tiers)
        return engine

    is_encoder = False   # EncoderEngine's counterpart: this engine generates

    @property
    def n_ctx(self) -> int:
        """Tokens one sequence may hold."""
        return self.runner.n_ctx

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes one token takes across all layers."""
        return self.runner.kv_bytes_per_token

    def use_prefix_tiers(self, config: PrefixTierConfig) -> PrefixTiers:
        """Keep computed blocks in host RAM and/or on disk below the pool (paged only), and
        restore prompts' prefixes from them at admission."""
        runner, kv = self.runner, self.runner.kv
        if not kv.paged:
            raise PagedError("prefix tiers need the paged KV cache")
        groups = runner.kv_groups
        identity = kv_identity(model_fingerprint(runner.model.gguf), runner.kv_cache_type, kv.block_size,
                               groups.layer_group, groups.group_window, runner.block_bytes)
        self.tiers = PrefixTiers(config, identity, kv.block_size, kv.n_groups, runner.block_bytes)
        kv.tier_writer = TierWriter(self.tiers, kv, runner.read_block)
        self.scheduler.tiers = self.tiers
        return self.tiers

    def close(self) -> None:
        """Free the runner (KV pools, compute context) and a model from_config loaded; queued
        disk-tier writes are finished first."""
        if self.tiers is not None:
            self.tiers.close()
        self.runner.close()
        if self._owned_model is not None:
            self._owned_model.close()
            self._owned_model = None
        if self.speculator is not None:   # a draft model and its pool
            self.speculator.close()
            self.speculator = None

    # ---- requests ----------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | EmbedParams | ScoreParams,
                    request_id: str | None = None) -> Request:
        """Queue a request (EmbedParams: an embedding; ScoreParams: the prompt's own
        log-probabilities); a request that can never fit is returned already finished."""
        params.validate()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise PagedError(f"request id {request_id!r} is already in flight")
        prompt_ids = self._checked_tokens(prompt_ids)
        embed = params if isinstance(params, EmbedParams) else None
        if embed is not None and embed.token_types is not None:
            raise RequestError("token types are for encoder models (text pairs); a decoder has none")
        score = params if isinstance(params, ScoreParams) else None
        sampled = not (embed or score)
        if sampled and params.logit_bias and max(params.logit_bias) >= self.runner.n_vocab:
            raise RequestError(f"logit_bias token id {max(params.logit_bias)} outside the vocabulary "
                               f"of {self.runner.n_vocab}")
        request = Request(request_id, prompt_ids, params if sampled else SamplingParams(), embed=embed,
                          score=score)
        request.seqs = [Sequence(list(prompt_ids), len(prompt_ids), Sampler(request.params))]
        self.scheduler.add(request)
        if request.status != RequestStatus.FINISHED:
            self.requests[request_id] = request
        return request

    def _checked_tokens(self, prompt_ids) -> list[int]:
        """The prompt as a list of ints; PagedError for ids the model has no row for,
        which would otherwise fail the whole batch's step."""
        ids = np.asarray(prompt_ids)
        if ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu"):
            raise RequestError("prompt token ids must be a flat list of integers")
        n_vocab = self.runner.n_vocab
        bad = ids[(ids < 0) | (ids >= n_vocab)] if ids.size else ids
        if bad.size:
            raise RequestError(f"token id {int(bad[0])} outside the vocabulary of {n_vocab}")
        return ids.tolist()

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        self._forget(request)
        return True

    def _forget(self, request: Request) -> None:
        """Drop what the engine holds for an ended request's sequences (pooled embedding
        rows, host copies of swapped pages)."""
        for seq in request.seqs:
            self.pooling.forget(seq.seq_id)
            self.scores.forget(seq.seq_id)
            self.swap_space.drop(seq.seq_id)
        if self.speculator is not None:   # a draft model's sequences
            self.speculator.forget(request.seqs)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One turn: schedule(), the KV moves it asks for, the runner over the batch,
        update_from_output() (progress), then sampling, forks and finishes. Returns the
        outputs of the requests that moved."""
        try:
            return self._step()
        finally:
            self._flush_kv_events()   # the step's prefix-cache changes, as one batch

    def _step(self) -> list[RequestOutput]:
        step_started = time.perf_counter()
        output = self.scheduler.schedule()
        self._move_kv(output)   # swaps and copy-on-write, before the step writes any KV
        outputs: dict[str, RequestOutput] = {}
        for request_id in output.failed_request_ids:
            request = self.requests.pop(request_id)
            self._forget(request)
            outputs[request_id] = self._output(request, finished=True)
        if not output.seq_ids:
            return list(outputs.values())
        owner = {s.seq_id: r for r in self.requests.values() for s in r.seqs}
        seqs = {s.seq_id: s for r in self.requests.values() for s in r.seqs}
        requests = [owner[seq_id] for seq_id in output.seq_ids]
        hidden = None
        if any(r.embed is not None for r in requests):
            hidden = [None if r.embed is None else
                      self.pooling.rows_wanted(r.embed.pooling, start, n, len(seqs[seq_id].token_ids))
                      for seq_id, r, (_, start, n) in zip(output.seq_ids, requests, output.items)]
        drafts = {}
        if self.speculator is not None:
            # a draft model catching up on a long prompt spends the step's spare prefill budget,
            # and the step's cost model learns those tokens as prefill
            drafts = self.speculator.draft(output, seqs, requests, self.runner.kv, self.runner.n_batch,
                                           self.limit, self.scheduler.spare_prefill_tokens)
            self.scheduler.charge_prefill(self.speculator.last_catch_up_tokens)
        started = time.perf_counter()
        logits, rows = self.runner.execute(output.items_array(), hidden,
                                           [r.score is not None for r in requests], drafts)
        self.forward_seconds += time.perf_counter() - started
        self.scheduler.update_from_output(output, seqs)
        self.num_computed_tokens += sum(output.num_tokens)
        if hidden is not None:
            self._pool_embeddings(output, hidden, rows, owner, seqs, outputs)
        drafts = {output.seq_ids[i]: d for i, d in drafts.items()}   # by sequence from here on
        self._postprocess(self._logit_rows(output, requests, seqs, logits, outputs, drafts), logits, owner,
                          outputs, drafts)
        elapsed = time.perf_counter() - step_started
        self.scheduler.observe_step(elapsed)
        self.step_seconds += elapsed
        self.num_steps += 1
        return list(outputs.values())

    def _move_kv(self, output: SchedulerOutput) -> None:
        """The KV data moves of a step, in the one safe order: read every swapped-out page
        (its block may be handed to another sequence in this same step), then write
        swapped-in pages, then copy-on-write."""
        for move in output.swap_out:
            self.swap_space.save(move, self.runner.read_block(move.block_id))
        for move in output.swap_in:
            self.runner.write_block(move.block_id, self.swap_space.take(move))
        for load in output.tier_loads:
            self.runner.write_block(load.block_id, load.data)
        for seq_id in output.resumed_seq_ids:
            self.swap_space.drop(seq_id)   # pages the prefix cache held came back without a write
        self.runner.copy_blocks(output.block_copies)

    def _logit_rows(self, output: SchedulerOutput, requests: list[Request], seqs: dict, logits: np.ndarray,
                    outputs: dict[str, RequestOutput], drafts: dict | None = None) -> list[tuple[Sequence, int]]:
        """Walk the step's logits rows in item order: a scoring chunk has one per token
        (scored here), a chunk that reached its sequence's last placed token one, an
        embedding none; a drafted decode one more per draft token. Returns the (sequence,
        row) pairs to sample: those whose every token is computed."""
        at, finishing = 0, []
        for seq_id, request, (_, start, n) in zip(output.seq_ids, requests, output.items):
            seq = seqs[seq_id]
            if request.score is not None:
                self._score_chunk(request, seq, start, logits[at:at + n], outputs)
                at += n
            elif request.embed is None and seq.kv.num_computed == seq.kv.num_tokens:
                if seq.kv.num_computed == len(seq.token_ids):
                    finishing.append((seq, at))
                at += 1 + len(drafts.get(seq_id, ())) if drafts else 1
        return finishing

    def _score_chunk(self, request: Request, seq: Sequence, start: int, logits: np.ndarray,
                     outputs: dict[str, RequestOutput]) -> None:
        """A scoring chunk's rows scored; the request finishes with them all (pages freed)
        when its last token is computed."""
        self.scores.add(seq.seq_id, seq.token_ids, start, logits, request.score.top_n)
        if seq.kv.num_computed == len(seq.token_ids):
            seq.finish_reason = "stop"
            out = outputs.setdefault(request.request_id, self._output(request))
            out.prompt_logprobs = self.scores.pop(seq.seq_id)
            self._finish(request, out)

    def _postprocess(self, finishing: list[tuple[Sequence, int]], logits: np.ndarray, owner: dict,
                     outputs: dict[str, RequestOutput], drafts: dict | None = None) -> None:
        """Sample every (sequence, logits row) that reached its last token in one call;
        append, fork (n>1), advance beams, finish. Drafted sequences (drafts: seq id ->
        tokens) are verified by the speculator instead."""
        drafts = drafts or {}
        ready: dict[str, list[tuple[Sequence, int]]] = {}   # request id -> (sequence, logits row)
        for seq, row in finishing:
            ready.setdefault(owner[seq.seq_id].request_id, []).append((seq, row))
        picks = []   # (request, sequence, row, sampler): every row of this step, drawn in one call
        beams: dict[str, list] = {}
        for request_id, items in ready.items():
            request = self.requests[request_id]
            outputs.setdefault(request_id, self._output(request))
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if request.is_beam:
                # a beam's row yields its 2 x width likeliest continuations and their log-probabilities
                expand = expansion_sampler(request.params.beam_width)
                beams[request_id] = [(seq, len(picks) + i) for i, (seq, _) in enumerate(items)]
                picks += [(request, seq, row, expand) for seq, row in items]
            else:
                picks += [(r, seq, row, seq.sampler) for r, seq, row in self._samples_of(request, items)
                          if seq.seq_id not in drafts]
        started = time.perf_counter()
        drawn = self.sampler.sample(logits, [(row, sampler, seq.token_ids) for _, seq, row, sampler in picks])
        self.sample_seconds += time.perf_counter() - started
        failed = {request.request_id: (request, sampled.error)
                  for (request, _, _, _), sampled in zip(picks, drawn) if sampled.error}
        for request, error in failed.values():   # one request's bad row fails it alone
            self._fail(request, outputs[request.request_id], error)
        for (request, seq, _, _), sampled in zip(picks, drawn):
            if not request.is_beam and request.request_id not in failed:
                self._accept(request, seq, sampled, outputs[request.request_id])
        for request_id, items in beams.items():
            if request_id not in failed:
                live = advance_beams(self.requests[request_id], [(seq, drawn[i].top) for seq, i in items],
                                     self.scheduler, self.eot_ids, self.limit)
                outputs[request_id].events.extend(TokenEvent(i, s.token_ids[-1]) for i, s in enumerate(live))
        if drafts:
            self._verify_drafts(finishing, drafts, logits, owner, outputs)
        for request_id in ready:
            request = self.requests.get(request_id)
            if request is not None and not request.live_seqs:
                self._finish(request, outputs[request_id])

    def _verify_drafts(self, finishing, drafts: dict, logits: np.ndarray, owner: dict,
                       outputs: dict[str, RequestOutput]) -> None:
        """The drafted sequences' tokens, from their rows (Speculator.verify)."""
        items = [(owner[seq.seq_id], seq, row, drafts[seq.seq_id]) for seq, row in finishing
                 if seq.seq_id in drafts and owner[seq.seq_id].request_id in self.requests]
        started = time.perf_counter()
        self.speculator.verify(
            self.sampler, logits, items,
            lambda r, seq, sampled: self._accept(r, seq, sampled, outputs[r.request_id]),
            lambda r, error: self._fail(r, outputs[r.request_id], error),
            lambda r: r.request_id in self.requests, self.runner.kv, self.runner.copy_blocks)
        self.sample_seconds += time.perf_counter() - started

    def _pool_embeddings(self, output: SchedulerOutput, hidden, rows: np.ndarray, owner: dict, seqs: dict,
                         outputs: dict[str, RequestOutput]) -> None:
        """Embedding chunks returned pooled rows, not logits; a request whose last token is
        computed finishes with its vector (pages freed)."""
        at = 0
        for seq_id, want, (_, start, _) in zip(output.seq_ids, hidden, output.items):
            if want is None:
                continue
            seq, request = seqs[seq_id], owner[seq_id]
            self.pooling.add(seq_id, request.embed.pooling, start, rows[at:at + want[1]])
            at += want[1]
            if seq.kv.num_computed == len(seq.token_ids):
                seq.finish_reason = "stop"
                out = outputs.setdefault(request.request_id, self._output(request))
                out.embedding = self.pooling.pop(seq_id)
                self._finish(request, out)

    def _output(self, request: Request, finished: bool = False) -> RequestOutput:
        return RequestOutput(request.request_id, finished=finished, error=request.error,
                             num_prompt_tokens=len(request.prompt_ids),
                             finish_reasons=[s.finish_reason for s in request.seqs])

    def _finish(self, request: Request, out: RequestOutput) -> None:
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        self._forget(request)
        out.finished = True
        out.finish_reasons = [s.finish_reason for s in request.seqs]
        if request.is_beam:
            out.beams = ranked_beams(request)

    def _fail(self, request: Request, out: RequestOutput, error: str) -> None:
        """End one request with an error (its pages freed); the step goes on for the rest."""
        request.error = out.error = error
        self._finish(request, out)

    def _accept(self, request: Request, seq: Sequence, sampled: Sampled, out: RequestOutput) -> None:
        """Append a sampled token, report it, and finish the sequence if it ended."""
        token = sampled.token
        out.events.append(TokenEvent(seq.index, token, sampled.logprob, sampled.top))
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if token in self.eot_ids and not request.params.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= (request.params.max_tokens or self.limit) or \
                len(seq.token_ids) >= self.limit:
            seq.finish_reason = "length"
        if seq.is_finished:
            self.scheduler.free_sequence(seq)   # finished sequences give their pages back at once

    def _samples_of(self, request: Request, items) -> list[tuple[Request, Sequence, int]]:
        """The sequences to sample for a request this step; an n>1 request forks its
        samples from the prompt's pages first, before anyone appends."""
        params = request.params
        picks = []
        for seq, row in items:
            if not request.is_forked and params.n > 1:
                request.is_forked = True
                for i in range(1, params.n):
                    child = Sequence(list(seq.token_ids), seq.num_prompt, Sampler(params.for_sample(i)),
                                     kv=self.scheduler.fork_sequence(seq), index=i)
                    request.seqs.append(child)
                    picks.append((request, child, row))
            picks.append((request, seq, row))
        return picks

    # ---- the prefix cache, as routers see it ---------------------------------
    def set_kv_event_listener(self, listener) -> None:
        """Tell listener (a KVEventListener) of every block the prefix cache stores or
        evicts, once per step (None: stop). Without a paged pool there is no cache to tell of."""
        if self.runner.kv.paged:
            self.runner.kv.watch_cache(listener)
            self._flush_kv_events()

    def reset_prefix_cache(self) -> dict:
        """Forget every cached prefix, in the pool and the RAM tier (running requests keep
        their pages); the disk tier is kept (docs/prefix-tiers.md). Returns what was done."""
        done = {"pool": False, "ram_tier_blocks": 0, "disk_tier_kept": None}
        if self.runner.kv.paged:
            self.runner.kv.reset_prefix_cache()
            done["pool"] = True
            self._flush_kv_events()
        if self.tiers is not None:
            done["ram_tier_blocks"] = self.tiers.clear_ram()
            if self.tiers.disk is not None:
                # shared with other servers and models on the directory and kept across restarts:
                # one server's reset is not theirs to undo
                done["disk_tier_kept"] = self.tiers.disk.directory
        return done

    def _flush_kv_events(self) -> None:
        if self.runner.kv.events is not None:
            self.runner.kv.events.flush()

    # ---- what callers read through the engine (never its runner or pool) ----
    def pool_figures(self) -> dict:
        """The pool as /api/pool and /metrics show it: stats and the pool's shape (counts
        from the pool's own counters, no walk over its blocks)."""
        kv = self.runner.kv
        return {"stats": self.stats(), "kv_pool_bytes": self.runner.kv_pool_bytes, "paged": kv.paged,
                "block_size": kv.block_size}

    # ---- statistics --------------------------------------------------------
    def stats(self) -> dict:
        """Pool and scheduler figures for /stats, metrics and benchmarks."""
        kv = self.runner.kv
        s = {"running_requests": len(self.scheduler.running), "waiting_requests": len(self.scheduler.waiting),
             "swapped_requests": len(self.scheduler.swapped),
             "running_seqs": self.scheduler.num_running_seqs(),
             "preemptions": self.scheduler.num_preemptions,
             "computed_tokens": self.num_computed_tokens, "generated_tokens": self.num_generated_tokens,
             "forward_seconds": self.forward_seconds, "sample_seconds": self.sample_seconds,
             "step_seconds": self.step_seconds, "steps": self.num_steps,
             "itl_budget_seconds": self.scheduler.itl_budget_seconds(),
             "step_cost_seconds": self.scheduler.step_cost.coefficients}
        if self.speculator is not None:
            s.update(self.speculator.stats())
        if self.tiers is not None:
            s.update(self.tiers.stats(), prefix_tier_hits=self.scheduler.tier_hit_tokens)
        s.update(kv_pool_bytes=self.runner.kv_pool_bytes,
                 kv_bytes_per_token_dense=self.runner.kv_bytes_per_token)
        if kv.paged:
            ps = kv.pool.stats()
            s.update(block_size=kv.block_size, blocks_total=ps.num_blocks, blocks_free=ps.num_free,
                     blocks_used=ps.num_used,
                     blocks_cached=ps.num_cached, blocks_shared=ps.num_shared,
                     utilization=ps.utilization, prefix_hit_rate=ps.hit_rate,
                     prefix_hits=ps.num_hits, cow_copies=ps.num_cow_copies,
                     prefix_cache_queries=self.scheduler.prefix_queried_tokens,
                     prefix_cache_hits=self.scheduler.prefix_hit_tokens,
                     kv_bytes_used=ps.num_used * self.runner.block_bytes,
                     kv_groups=self.runner.kv_bytes_by_group())
        else:
            s.update(blocks_total=kv.num_blocks, blocks_used=kv.num_in_use,
                     blocks_free=kv.num_blocks - kv.num_in_use)
        return s
