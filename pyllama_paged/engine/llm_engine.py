"""LLMEngine: one step is five calls: Scheduler.schedule() (plain data: ids and
counts), the KV data moves it asks for (KVMover.apply), execute (the speculator's
drafts, ModelRunner.execute over the batch, the filled blocks down to the tiers),
Scheduler.update_from_output() (progress), then the rows' effects on the requests
(Postprocessor.process: sample, fork, beams, score, pool, finish).
Single-threaded; EngineLoop runs it for many callers."""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings

import numpy as np

from .config import EngineConfig
from .worker.devices import device_kv_budget
from .worker.model import Model, load_model
from .worker.model_runner import ModelRunner, dense_kv_bytes_per_token
from .outputs import RequestOutput
from ..errors import ModelLoadError, PagedError, RequestError
from .worker.sampler import BatchSampler, Sampler
from .params import EmbedParams, LoraRequest, SamplingParams, ScoreParams
from .worker.lora import LoraAdapter
from .kv_moves import KVMover
from .kv.prefix_tiers import PrefixTierConfig, PrefixTiers, kv_identity, model_fingerprint
from .postprocess import ExecutedStep, Postprocessor
from .sched.scheduler import Scheduler, SchedulerConfig
from .sched.scheduler_output import SchedulerOutput
from .spec_decode.verify import Speculator
from .spec_decode.draft_model import drafter_for
from .sched.request import Request, RequestStatus, Sequence
from ..tokenizer.tokenizer import Tokenizer


def _tiers_on(config: EngineConfig) -> bool:
    """Whether config asks for prefix tiers below the pool."""
    return config.prefix_tiers is not None and config.prefix_tiers.enabled and config.paged


def _off_for_hybrids(config: EngineConfig) -> str:
    """What config asks for that a hybrid runs without ("" for nothing): a prefix from a tier
    would come without the state at its end, and swap's host copies hold pages, not states."""
    off = [what for what, asked in (("prefix tiers are off", _tiers_on(config)),
                                     ("preemption recomputes instead of swapping",
                                      config.scheduler.preemption_mode == "swap")) if asked]
    return ", ".join(off)


def runner_config(config: EngineConfig, model: Model) -> EngineConfig:
    """config as the runner of model takes it: the context resolved against the model's
    training context, and a model with layers on a GPU given a pool that fits its free memory
    unless the budget was set."""
    n_ctx = config.context_for(model.config.n_ctx_train)
    resolved = dataclasses.replace(config, n_ctx=n_ctx)
    if model.device is not None and not config.kv_budget_given:
        dense = dense_kv_bytes_per_token(model.config, config.kv_cache_type)
        resolved.kv_bytes = device_kv_budget(model, config.kv_budget_bytes(n_ctx, dense))
    return resolved


class LLMEngine:
    """Requests in, token events out, one step at a time."""

    def __init__(self, runner: ModelRunner, eot_ids, config: SchedulerConfig | None = None):
        self.runner = runner
        self.eot_ids = frozenset(eot_ids)
        self.scheduler = Scheduler(runner.kv, runner.n_ctx, config, block_bytes=runner.block_bytes)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_computed_tokens = 0          # tokens run through the model
        self.limit = min(runner.n_ctx, runner.kv.capacity_tokens())
        self.forward_seconds = 0.0            # time in the model step, for /stats
        self.step_seconds = 0.0               # whole steps that ran the model (schedule to outputs)
        self.num_steps = 0
        self.kv_moves = KVMover(runner)       # the KV data each step moves (and the swap space)
        # what each step's rows do to the requests
        self.post = Postprocessor(self.requests, self.scheduler, BatchSampler(runner.n_vocab, runner.n_threads),
                                  self.eot_ids, self.forget, runner.copy_blocks)
        self._owned_model = None              # a model from_config loaded (closed with the engine)
        self.speculator: Speculator | None = None   # speculative decoding (use_speculator)
        self.tiers: PrefixTiers | None = None       # the prefix cache below the pool (use_prefix_tiers)
        self.loras: dict[str, LoraAdapter] = {}     # LoRA adapters by name (add_lora)
        self.default_lora: LoraRequest | None = None   # what a request naming none runs (Llama(lora_path=))

    @classmethod
    def from_config(cls, config: EngineConfig, *, model: Model | None = None, eot_ids=None) -> "LLMEngine":
        """The engine config describes: its model (load_model(config) unless given; one loaded
        here is closed with the engine), KV pool, runner, scheduler, speculator and tiers.
        eot_ids: the ids that end generation (None: the GGUF tokenizer's)."""
        owned = model is None
        model = model or load_model(config)
        try:
            runner = ModelRunner(model, runner_config(config, model))
            if eot_ids is None:
                eot_ids = Tokenizer.from_metadata(model.metadata).eot_ids
        except BaseException:
            if owned:
                model.close()
            raise
        engine = cls(runner, eot_ids, config.scheduler)
        engine._owned_model = model if owned else None
        off = _off_for_hybrids(config) if runner.hybrid else ""
        if off:
            warnings.warn(f"{model.path}: {off} for a hybrid model (Gated DeltaNet layers: their recurrent "
                          "state is neither in the tiers' blocks nor in swap's host copies)", UserWarning, stacklevel=2)
        try:   # a draft model (method draft_model) loads here, checked against the target
            if config.speculative is not None:
                engine.use_speculator(Speculator(config.speculative,
                                                 drafter_for(config.speculative, model, runner, config)))
            if _tiers_on(config) and not runner.hybrid:
                engine.use_prefix_tiers(config.prefix_tiers)
        except BaseException:
            engine.close()
            raise
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

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled so far, all requests together."""
        return self.post.num_generated_tokens

    def use_speculator(self, speculator: Speculator | None) -> None:
        """Speculate with speculator from the next step (None: stop); the engine closes it."""
        self.speculator = self.post.speculator = speculator

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
        self.kv_moves.tiers = self.scheduler.tiers = self.tiers
        return self.tiers

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the runner (KV pools, compute context) and a model from_config loaded; queued
        disk-tier writes are finished first."""
        if self.tiers is not None:
            self.tiers.close()
        self.runner.close()
        for adapter in self.loras.values():
            adapter.close()
        self.loras.clear()
        if self._owned_model is not None:
            self._owned_model.close()
            self._owned_model = None
        if self.speculator is not None:   # a draft model and its pool
            self.speculator.close()
            self.use_speculator(None)

    # ---- LoRA adapters -----------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoraAdapter:
        """Load a LoRA adapter file for this engine's model under name (requests pick it with
        SamplingParams.lora); ModelLoadError for a file that is not an adapter of this model."""
        if not isinstance(name, str) or not name:
            raise RequestError("a LoRA adapter needs a non-empty name")
        if name in self.loras:
            raise RequestError(f"a LoRA adapter named {name!r} is already loaded")
        if self.runner.hybrid:   # the state checkpoints and the delta-rule layers know no adapters yet
            raise ModelLoadError(f"{path}: LoRA adapters are not supported on hybrid models "
                                 f"({self.runner.model.config.arch}) yet")
        adapter = LoraAdapter(self.runner.model, path)
        self.loras[name] = adapter
        return adapter

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; RequestError while a request in flight runs it, or if unknown."""
        adapter = self.loras.get(name)
        if adapter is None:
            raise RequestError(f"no LoRA adapter named {name!r} is loaded")
        if any(r.lora is not None and r.lora[0] is adapter for r in self.requests.values()):
            raise RequestError(f"LoRA adapter {name!r} is in use by a running request")
        del self.loras[name]
        if self.default_lora is not None and self.default_lora.name == name:
            self.default_lora = None
        adapter.close()

    def _lora_of(self, wanted: LoraRequest | None) -> tuple | None:
        """(adapter, scale) a request runs: its own LoraRequest, else the engine's default."""
        wanted = wanted if wanted is not None else self.default_lora
        if wanted is None or wanted.scale == 0.0:
            return None   # scale 0 adds nothing: the base model's KV, and its prefix cache
        adapter = self.loras.get(wanted.name)
        if adapter is None:
            known = ", ".join(sorted(self.loras)) or "none"
            raise RequestError(f"no LoRA adapter named {wanted.name!r} is loaded (loaded: {known})")
        return adapter, float(wanted.scale)

    # ---- requests ----------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | EmbedParams | ScoreParams,
                    request_id: str | None = None, images=()) -> Request:
        """Queue a request (EmbedParams: an embedding; ScoreParams: the prompt's own
        log-probabilities); a request that can never fit is returned already finished.
        images: (first position, EncodedImage) pairs whose rows replace the prompt's
        placeholder tokens there (vision/image_cache.py)."""
        params.validate()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise PagedError(f"request id {request_id!r} is already in flight")
        prompt_ids = self._checked_tokens(prompt_ids)
        placed = self._placed_images(prompt_ids, images)
        embed = params if isinstance(params, EmbedParams) else None
        if embed is not None and embed.token_types is not None:
            raise RequestError("token types are for encoder models (text pairs); a decoder has none")
        score = params if isinstance(params, ScoreParams) else None
        sampled = not (embed or score)
        if sampled and params.logit_bias and max(params.logit_bias) >= self.runner.n_vocab:
            raise RequestError(f"logit_bias token id {max(params.logit_bias)} outside the vocabulary "
                               f"of {self.runner.n_vocab}")
        if placed and not sampled:
            raise RequestError("images are for generation requests, not embeddings or scoring")
        request = Request(request_id, prompt_ids, params if sampled else SamplingParams(), embed=embed,
                          score=score, lora=None if embed else self._lora_of(params.lora), images=placed)
        # max_tokens resolved here, once: the prompt and at most that many tokens (0 or None: to
        # the context), within the context
        request.max_len = min(self.limit, len(prompt_ids) + (request.params.max_tokens or self.limit))
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

    def _placed_images(self, prompt_ids: list[int], images) -> list:
        """Each image's token ids written over its placeholder positions of prompt_ids (in
        place); its (first position, embedding rows) for the runner. RequestError for images
        that overlap, leave the prompt or are not as wide as the model's embedding."""
        placed, end = [], 0
        for start, image in sorted(images, key=lambda pair: pair[0]):
            rows = image.embeddings
            if rows.ndim != 2 or rows.shape[1] != self.runner.model.config.n_embd:
                raise RequestError(f"image rows are {list(rows.shape)}; the model's embedding is "
                                   f"{self.runner.model.config.n_embd} wide")
            if start < end or start + len(rows) > len(prompt_ids):
                raise RequestError(f"an image at position {start} overlaps another or leaves the prompt")
            prompt_ids[start:start + len(rows)] = image.token_ids()
            placed.append((start, rows))
            end = start + len(rows)
        return placed

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        self.forget(request)
        return True

    def forget(self, request: Request) -> None:
        """Drop what the engine holds for an ended request's sequences (pooled embedding
        rows, scores, host copies of swapped pages, a draft model's sequences)."""
        for seq in request.seqs:
            self.post.forget(seq.seq_id)
            self.kv_moves.forget(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(request.seqs)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One turn: schedule(), the KV moves it asks for, the runner over the batch,
        update_from_output() (progress), then sampling, forks and finishes. Returns the
        outputs of the requests that moved."""
        started, steps = time.perf_counter(), self.num_steps
        try:
            outputs = self._step()
            if self.num_steps > steps:   # the model ran: the step's cost model learns how long it took
                elapsed = time.perf_counter() - started
                self.scheduler.observe_step(elapsed)
                self.step_seconds += elapsed
            return outputs
        finally:
            self._flush_kv_events()   # the step's prefix-cache changes, as one batch

    def _step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()                        # 1. what runs: ids and counts
        self.kv_moves.apply(output)                               # 2. the KV data it moves, in order
        step = self._execute(output)                              # 3. drafts, the model, tier saves
        self.scheduler.update_from_output(output, step.seqs)      # 4. progress
        return self.post.process(output, step)                    # 5. sample, fork, beams, score, pool, finish

    def _execute(self, output: SchedulerOutput) -> ExecutedStep:
        """The step's batch on the model: the speculator's drafts first (a draft model catching
        up on a long prompt spends the step's spare prefill budget, and the step's cost model
        learns those tokens as prefill), then the runner, then the blocks the step filled down
        to the tiers, before the commit can give a sliding-window group's blocks back. A step
        that scheduled nothing runs nothing."""
        if not output.seq_ids:
            return ExecutedStep()
        step = self._batch_of(output)
        if self.speculator is not None:
            step.drafts = self.speculator.draft(output, step.seqs, step.requests, self.runner.kv,
                                                self.runner.n_batch, self.scheduler.spare_prefill_tokens)
            self.scheduler.charge_prefill(self.speculator.last_catch_up_tokens)
        self._run(output, step)
        self.kv_moves.save_to_tiers(output)
        return step

    def _batch_of(self, output: SchedulerOutput) -> ExecutedStep:
        """The step's sequences and their requests, and the pooled rows its embedding chunks want."""
        owner = {s.seq_id: r for r in self.requests.values() for s in r.seqs}
        seqs = {s.seq_id: s for r in self.requests.values() for s in r.seqs}
        requests = [owner[seq_id] for seq_id in output.seq_ids]
        return ExecutedStep(seqs, owner, requests, self.post.hidden_rows(output, requests, seqs))

    def _run(self, output: SchedulerOutput, step: ExecutedStep) -> None:
        """ModelRunner.execute over the step's items: its logits (and pooled) rows into step."""
        # every row drawn by argmax: a step that computes them on a device reads back ids alone
        argmax_only = step.hidden is None and not step.drafts and all(
            r.score is None and not r.is_beam and all(s.sampler.plain_greedy for s in r.live_seqs)
            for r in step.requests)
        started = time.perf_counter()
        images = [r.images for r in step.requests] if any(r.images for r in step.requests) else None
        step.logits, step.rows = self.runner.execute(output.items_array(), step.hidden,
                                                     [r.score is not None for r in step.requests], step.drafts,
                                                     argmax_only, images)
        step.argmax = self.runner.step_argmax() if argmax_only else None
        self.forward_seconds += time.perf_counter() - started
        self.num_computed_tokens += sum(output.num_tokens)
        self.num_steps += 1

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
        """The pool as /api/pool, /api/ps and /metrics show it: stats and the pool's shape
        (counts from the pool's own counters, no walk over its blocks), and its bytes on a GPU."""
        kv = self.runner.kv
        return {"stats": self.stats(), "kv_pool_bytes": self.runner.kv_pool_bytes, "paged": kv.paged,
                "block_size": kv.block_size, "kv_device_bytes": self.runner.kv_device_bytes}

    # ---- statistics --------------------------------------------------------
    def stats(self) -> dict:
        """Pool and scheduler figures for /stats, metrics and benchmarks."""
        kv = self.runner.kv
        s = {"running_requests": len(self.scheduler.running), "waiting_requests": len(self.scheduler.waiting),
             "swapped_requests": len(self.scheduler.swapped),
             "running_seqs": self.scheduler.num_running_seqs(),
             "preemptions": self.scheduler.num_preemptions,
             "computed_tokens": self.num_computed_tokens, "generated_tokens": self.num_generated_tokens,
             "forward_seconds": self.forward_seconds, "sample_seconds": self.post.sample_seconds,
             "step_seconds": self.step_seconds, "steps": self.num_steps,
             "itl_budget_seconds": self.scheduler.itl_budget_seconds(),
             "step_cost_seconds": self.scheduler.step_cost.coefficients}
        if self.speculator is not None:
            s.update(self.speculator.stats())
        if self.tiers is not None:
            s.update(self.tiers.stats(), prefix_tier_hits=self.scheduler.tier_hit_tokens)
        s.update(kv_pool_bytes=self.runner.kv_pool_bytes,
                 kv_bytes_per_token_dense=self.runner.kv_bytes_per_token)
        if self.runner.hybrid:   # the recurrent state slots, out of the same budget
            hkv, states = self.runner.kv, self.runner.state_pool
            s.update(state_slots_total=states.num_slots, state_slots_running=hkv.running_slots,
                     state_slots_used=states.num_slots - states.num_free - hkv.num_checkpoints,
                     state_bytes_per_seq=states.bytes_per_slot, state_pool_bytes=states.pool_bytes,
                     state_checkpoints=hkv.num_checkpoints, state_checkpoint_saves=hkv.checkpoint_saves,
                     state_checkpoint_hits=hkv.checkpoint_hits,
                     state_checkpoint_hit_tokens=hkv.checkpoint_hit_tokens)
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
