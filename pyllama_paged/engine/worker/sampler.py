"""Each sequence's sampling state, and the batched sampler
that draws every row of a step in one native call (native/src/kernels/sampler.c)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from ..._native import PP_OK, NativeHandle, check, ffi, lib
from ...constrain.masks import MaskBuffer
from ...errors import PagedError
from ..params import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of a 1-D array (float64)."""
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Sampler:
    """One sequence's sampling: its parameters and its own generator state
    (seeded, so a seed gives the same draws whatever else is in the batch)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.rng_state = np.array([lib.pp_sampler_seed(seed % (1 << 64))], dtype=np.uint64)
        self.rng_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.rng_state))   # what a row points at
        self.constraint = params.constraint.start() if params.constraint is not None else None
        self.native_params = None   # (n_vocab, pp_sampling_params *) once a BatchSampler made it
        self.bias = None            # (token ids, biases) arrays, when params.logit_bias is set
        if params.logit_bias:
            self.bias = (np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias)),
                         np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias)))
        # a thinking budget spent: the think block's close tag is forced, a token a step
        self.budget = params.thinking_budget.start() if params.thinking_budget is not None else None
        self.adjusts_logits = self.bias is not None or params.logits_processor is not None or self.budget is not None
        # the row's argmax is its draw: no penalty, bias, processor, grammar or logprobs
        self.plain_greedy = (params.greedy and params.logprobs is None and not self.adjusts_logits
                             and self.constraint is None and params.repeat_penalty == 1.0
                             and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)

    def history(self, token_ids: list[int]) -> list[int]:
        """The tokens the penalties count: the last penalty_last_n (all if 0), or none
        when no penalty is set."""
        p = self.params
        if p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            return []
        counted = token_ids[-p.penalty_last_n:] if p.penalty_last_n > 0 else token_ids
        # an image's positions hold negative ids (no vocabulary row): nothing to penalise
        return [t for t in counted if t >= 0] if counted and min(counted) < 0 else counted


@dataclass
class Sampled:
    """One row's draw; logprob and top (token id -> log-probability, best first)
    only when its parameters asked for logprobs."""

    token: int
    logprob: float | None = None
    top: dict[int, float] | None = None
    error: str | None = None   # this row could not be drawn (its request fails alone); token is -1


_TINY, _HUGE = 1e-30, 1e30


def _clamp(value: float, low: float) -> float:
    return min(max(value, low), _HUGE) if value != 0 else 0.0


class BatchSampler(NativeHandle):
    """Every row of a step sampled in one native call; buffers reused across steps."""

    _destroy = staticmethod(lib.pp_sampler_destroy)

    def __init__(self, n_vocab: int, n_threads: int = 1):
        self.n_vocab = n_vocab
        self._masks: MaskBuffer | None = None
        self._capacity = 0
        out = ffi.new("pp_sampler **")
        # a host with more cores than the sampler spreads rows over still gets a sampler
        threads = max(1, min(n_threads, lib.PP_SAMPLER_MAX_THREADS))
        check(lib.pp_sampler_create(n_vocab, threads, out), "sampler")
        self._handle = out[0]

    def sample(self, logits: np.ndarray, picks) -> list[Sampled]:
        """picks: (logits row, Sampler, token history) per sequence to sample. A row whose
        logits processor or grammar fails, or that allows no finite logit, comes back with
        an error and the others are drawn as usual."""
        if not picks:
            return []
        if logits.dtype != np.float32 or not logits.flags.c_contiguous or logits.shape[-1] != self.n_vocab:
            raise PagedError(f"logits must be C-contiguous float32 rows of {self.n_vocab}")
        out: list[Sampled | None] = [None] * len(picks)
        for k, message in self._adjust_logits(logits, picks).items():
            out[k] = Sampled(-1, error=message)
        live = [k for k in range(len(picks)) if out[k] is None]
        if not live:
            return out
        rows, results = self._arrays(len(live))
        keep = self._allowed_masks(rows, [picks[k] for k in live], out, live)   # must outlive the call
        for r, k in zip(rows, live):
            row_index, sampler, history = picks[k]
            r.logit_row = row_index
            r.params = self._params_of(sampler)[0]
            counted = sampler.history(history)
            if counted:
                arr = np.asarray(counted, dtype=np.int32)
                keep.append(arr)
                r.history = ffi.cast("const int32_t *", ffi.from_buffer(arr))
                r.n_history = len(arr)
            r.rng_state = sampler.rng_ptr
        status = lib.pp_sample(self._handle, ffi.cast("const float *", ffi.from_buffer(logits)),
                               logits.shape[0] if logits.ndim == 2 else 1, self._rows, len(live), self._results)
        failed_rows = status != PP_OK and any(res.token < 0 for res in results)
        if status != PP_OK and not failed_rows:
            check(status, "sample")
        for res, k in zip(results, live):
            sampler = picks[k][1]
            if out[k] is not None:   # its grammar failed before the call
                continue
            if res.token < 0:
                out[k] = Sampled(-1, error="no token can be sampled: every allowed token's logit is -inf "
                                           "or not finite (logit_bias, grammar or logits processor)")
                continue
            if sampler.budget is not None:
                sampler.budget.accept(res.token)
            if sampler.constraint is not None:
                try:
                    sampler.constraint.accept(res.token)
                except Exception as e:  # the grammar engine's failure is this request's
                    out[k] = Sampled(-1, error=f"grammar: {type(e).__name__}: {e}")
                    continue
            if sampler.params.logprobs is None:
                out[k] = Sampled(res.token)
            else:
                top = {int(res.top_ids[j]): float(res.top_logprobs[j]) for j in range(res.n_top)}
                out[k] = Sampled(res.token, float(res.logprob), top)
        return out

    def _adjust_logits(self, logits: np.ndarray, picks) -> dict[int, str]:
        """Apply each row's logit_bias, then its logits processor, then its thinking budget's
        forced token, in place (the rows are
        the runner's buffer of this step, read by nothing after sampling). Returns the
        rows whose processor failed, with why."""
        failed: dict[int, str] = {}
        for k, (row_index, sampler, history) in enumerate(picks):
            if not sampler.adjusts_logits:
                continue
            row = logits.reshape(-1, self.n_vocab)[row_index]
            if sampler.bias is not None:
                ids, bias = sampler.bias
                row[ids] += bias
            processor = sampler.params.logits_processor
            if processor is not None:
                try:
                    adjusted = processor(np.asarray(history, dtype=np.intc), row)
                    if adjusted is not row:
                        row[:] = adjusted
                except Exception as e:  # the caller's code: it fails its own request only
                    failed[k] = f"logits_processor raised {type(e).__name__}: {e}"
            forced = sampler.budget.forced if sampler.budget is not None else None
            if forced is not None:   # last: what the budget forces, nothing undoes
                row.fill(-np.inf)
                row[forced] = 0.0
        return failed

    def _arrays(self, n: int):
        """The rows and results of a call of n rows: reused, grown as needed, rows zeroed."""
        if n > self._capacity:
            self._capacity = max(n, 2 * self._capacity)
            self._rows = ffi.new("pp_sample_row[]", self._capacity)
            self._results = ffi.new("pp_sample_result[]", self._capacity)
            self._zeros = bytes(ffi.sizeof("pp_sample_row") * self._capacity)
        rows = ffi.cast("pp_sample_row *", self._rows)
        ffi.memmove(rows, self._zeros, ffi.sizeof("pp_sample_row") * n)   # no history or mask left over
        return ffi.cast("pp_sample_row *", self._rows)[0:n], self._results[0:n]

    def _params_of(self, sampler: "Sampler"):
        """The sampler's parameters as the native struct, made once per sampler."""
        cached = sampler.native_params
        if cached is not None and cached[0] == self.n_vocab:
            return cached[1]
        p = sampler.params
        sp = ffi.new("pp_sampling_params *")
        # valid doubles beyond float's range are clamped, never turned into 0 or inf
        sp.temperature = _clamp(p.temperature, 0.0)
        sp.top_k = min(p.top_k, self.n_vocab)   # any k >= the vocabulary keeps it all
        sp.top_p = max(p.top_p, _TINY)
        sp.min_p = p.min_p
        sp.repeat_penalty = _clamp(p.repeat_penalty, _TINY)
        sp.presence_penalty = _clamp(p.presence_penalty, -_HUGE)
        sp.frequency_penalty = _clamp(p.frequency_penalty, -_HUGE)
        sp.n_logprobs = -1 if p.logprobs is None else p.logprobs
        sampler.native_params = (self.n_vocab, sp)
        return sp

    def _allowed_masks(self, rows, picks, out, live) -> list:
        """Point each constrained row at its grammar's token mask, all computed in one batch.
        A grammar that fails marks its row (out[live[i]]) and lets it allow nothing."""
        constrained = [i for i, (_, sampler, _) in enumerate(picks) if sampler.constraint is not None]
        if not constrained:
            return []
        if self._masks is None:
            self._masks = MaskBuffer(self.n_vocab)
        allowed = self._masks.fill([picks[i][1].constraint for i in constrained])
        for k, i in enumerate(constrained):
            rows[i].allowed = ffi.cast("const uint8_t *", ffi.from_buffer(allowed[k]))
        return [allowed]
