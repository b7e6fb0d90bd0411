"""Encoder-only models (bert): the native encoder context and an engine with
LLMEngine's surface (add_request, step, abort, has_work, requests, stats), so
EngineLoop, the server and Llama drive it unchanged. There is no KV cache:
each step takes the waiting inputs of every request in arrival order (up to a
token budget), sorts them by length so padding stays small, runs them as a
few padded graphs and finishes them all with their pooled vectors."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from ..._native import NativeHandle, check, ffi, lib
from ...errors import PagedError
from ..params import EmbedParams
from ..outputs import RequestOutput
from ..worker.model import Model

_POOLING_IDS = {"mean": lib.PP_POOLING_MEAN, "cls": lib.PP_POOLING_CLS, "last": lib.PP_POOLING_LAST}   # enum pp_pooling


class NoKV:
    """What an encoder has for a KV cache: nothing (the pool views show zero blocks)."""

    paged = False
    num_blocks = 0
    block_size = 0
    num_in_use = 0

    def capacity_tokens(self) -> int:
        return 0


class EncoderRunner(NativeHandle):
    """One encoder model's compute context: inputs in, pooled token states out. close() frees
    the native context (the model is the caller's)."""

    _destroy = staticmethod(lib.pp_encoder_destroy)

    def __init__(self, model: Model, n_threads: int = 2, max_batch_tokens: int = 4096):
        if not model.config.is_encoder:
            raise PagedError(f"{model.path}: '{model.config.arch}' is not an encoder model")
        self.model = model
        self.n_threads = n_threads
        self.max_batch_tokens = max(max_batch_tokens, model.config.n_ctx_train)   # one longest input fits
        self.n_ctx = model.config.n_ctx_train
        self.n_token_types = model.n_token_types
        self.kv = NoKV()
        self.kv_bytes_per_token = 0
        self.kv_pool_bytes = 0
        out = ffi.new("pp_encoder **")
        check(lib.pp_encoder_create(model.native, n_threads, self.max_batch_tokens, out), "encoder context")
        self._handle = out[0]

    @property
    def n_vocab(self) -> int:
        return self.model.config.n_vocab

    def embed(self, inputs: list[list[int]], pooling: str = "mean", types: list | None = None) -> np.ndarray:
        """Pooled last-layer states [len(inputs), n_embd] of inputs that fit one call
        (len(inputs) * longest <= max_batch_tokens); types: each input's token types (None: 0)."""
        if self._handle is None:
            raise PagedError("this encoder is closed")
        lens = np.array([len(ids) for ids in inputs], dtype=np.int32)
        total = int(lens.sum())
        flat = np.fromiter(itertools.chain.from_iterable(inputs), dtype=np.int32, count=total)
        out = np.empty((len(inputs), self.model.config.n_embd), dtype=np.float32)
        i32 = "int32_t *"
        typ = ffi.NULL
        if types is not None:   # the array stays referenced (flat_types) until the call returns
            flat_types = np.fromiter(itertools.chain.from_iterable(types), dtype=np.int32, count=total)
            typ = ffi.cast(i32, ffi.from_buffer(flat_types))
        check(lib.pp_encoder_embed(self._handle, ffi.cast(i32, ffi.from_buffer(flat)), typ,
                                   ffi.cast(i32, ffi.from_buffer(lens)), len(inputs), _POOLING_IDS[pooling],
                                   ffi.cast("float *", ffi.from_buffer(out))), "encoder")
        return out


@dataclass
class EncoderRequest:
    request_id: str
    prompt_ids: list[int]
    params: EmbedParams
    arrival: float = field(default_factory=time.monotonic)
    error: str | None = None


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of inputs grouped into padded batches of at most budget tokens
    (count x longest), shortest first, so each batch pads little."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) + 1) * lengths[i] > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class EncoderEngine:
    """Embedding requests in, pooled vectors out, many requests' inputs per step."""

    def __init__(self, runner: EncoderRunner, eot_ids=(), config=None):
        self.runner = runner
        self.requests: dict[str, EncoderRequest] = {}
        self._ids = itertools.count()
        self.limit = runner.n_ctx
        self.num_computed_tokens = 0
        self.num_steps = 0
        self.forward_seconds = 0.0

    def add_request(self, prompt_ids: list[int], params, request_id: str | None = None) -> EncoderRequest:
        """Queue an embedding; a generation request is refused (PagedError), an input that
        can never fit is returned already finished with its error."""
        if not isinstance(params, EmbedParams):
            raise PagedError(f"'{self.runner.model.config.arch}' is an embedding model: it cannot generate text")
        params.validate()
        request_id = request_id or f"emb-{next(self._ids)}"
        if request_id in self.requests:
            raise PagedError(f"request id {request_id!r} is already in flight")
        ids = [int(t) for t in prompt_ids]
        request = EncoderRequest(request_id, ids, params)
        n_vocab = self.runner.n_vocab
        if not ids:
            request.error = "the input is empty"
        elif len(ids) > self.limit:
            request.error = f"input of {len(ids)} tokens exceeds the model's context of {self.limit}"
        elif any(not 0 <= t < n_vocab for t in ids):
            request.error = f"token id outside the vocabulary of {n_vocab}"
        elif params.token_types is not None and len(params.token_types) != len(ids):
            request.error = f"{len(params.token_types)} token types for {len(ids)} tokens"
        elif params.token_types is not None and any(not 0 <= t < self.runner.n_token_types
                                                    for t in params.token_types):
            # checked here: the native call would refuse the whole batch for one bad input
            request.error = f"token types must be below {self.runner.n_token_types} (the model's count)"
        if request.error is None:
            self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request; False if unknown or finished."""
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Embed the waiting inputs (oldest first, up to a budget of real tokens); all finish."""
        started = time.perf_counter()
        budget = self.runner.max_batch_tokens
        taken: list[EncoderRequest] = []
        for request in self.requests.values():   # insertion order: arrival
            if taken and sum(len(r.prompt_ids) for r in taken) + len(request.prompt_ids) > budget:
                break
            taken.append(request)
        outputs = []
        for pooling in {r.params.pooling for r in taken}:
            group = [r for r in taken if r.params.pooling == pooling]
            for batch in pack([len(r.prompt_ids) for r in group], budget):
                members = [group[i] for i in batch]
                types = None
                if any(r.params.token_types is not None for r in members):   # text pairs in the batch
                    types = [r.params.token_types or (0,) * len(r.prompt_ids) for r in members]
                vectors = self.runner.embed([r.prompt_ids for r in members], pooling, types)
                for r, vec in zip(members, vectors):
                    outputs.append(RequestOutput(r.request_id, finished=True, finish_reasons=["stop"],
                                                 num_prompt_tokens=len(r.prompt_ids), embedding=vec))
        for r in taken:
            del self.requests[r.request_id]
            self.num_computed_tokens += len(r.prompt_ids)
        self.num_steps += 1
        self.forward_seconds += time.perf_counter() - started
        return outputs

    @property
    def n_ctx(self) -> int:
        """Tokens one input may hold."""
        return self.runner.n_ctx

    kv_bytes_per_token = 0   # no KV cache
    is_encoder = True

    def close(self) -> None:
        """Free the encoder's compute context (the model is its caller's)."""
        self.runner.close()

    def pool_figures(self) -> dict:
        """LLMEngine.pool_figures's shape: no KV pool."""
        return {"stats": self.stats(), "kv_pool_bytes": 0, "paged": False, "block_size": 0}

    def stats(self) -> dict:
        """Queue and work figures in LLMEngine.stats()'s names (no KV pool: zero blocks)."""
        return {"running_requests": 0, "waiting_requests": len(self.requests), "swapped_requests": 0,
                "running_seqs": 0, "preemptions": 0, "computed_tokens": self.num_computed_tokens,
                "generated_tokens": 0, "forward_seconds": self.forward_seconds, "sample_seconds": 0.0,
                "step_seconds": self.forward_seconds, "steps": self.num_steps,
                "blocks_total": 0, "blocks_used": 0, "blocks_free": 0}


def encoder_engine(model: Model, n_threads: int) -> tuple[EncoderRunner, EncoderEngine]:
    """The runner and engine an encoder model is served with."""
    runner = EncoderRunner(model, n_threads=n_threads)
    return runner, EncoderEngine(runner)
