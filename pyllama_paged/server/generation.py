"""One generation as the HTTP handlers run it: limits, submission to the
model's engine loop, text assembly, timing, and abort on disconnect."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..engine.sampler import SamplingParams
from ..errors import PagedError
from ..sampling_options import Surface, sampling_params
from ..text_stream import TextAssembler, TextDelta
from .metrics import Metrics
from .registry import ServedModel


class APIError(Exception):
    """An HTTP error with the field it concerns (if any)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, error_type
        self.headers = headers or {}
        self.code = code


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None    # None: the model's context
    max_tokens: int = 4096
    max_n: int = 8
    max_queue: int = 256                    # requests waiting beyond those running
    max_prompts: int = 32                   # prompts in one /v1/completions request
    max_embedding_inputs: int = 2048        # inputs in one embedding request (OpenAI's limit)


@dataclass
class Generation:
    served: ServedModel
    prompt_ids: list[int]
    params: SamplingParams
    metrics: Metrics
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)   # sample 0's tokens, end-of-turn excluded
    load_seconds: float = 0.0   # loading the model again (keep_alive had dropped it)

    async def deltas(self):
        """Async iterator of TextDelta; aborts the request if the consumer goes away."""
        served = self.served
        self.metrics.inflight[served.name] += 1
        try:
            self.load_seconds = await served.acquire()
        except BaseException:
            self.metrics.inflight[served.name] -= 1
            raise
        try:
            stream = served.loop.submit(self.prompt_ids, self.params)
        except BaseException:
            served.release()
            self.metrics.inflight[served.name] -= 1
            raise
        assembler = TextAssembler(served.tokenizer, self.params.stop)
        width = self.params.beam_width if self.params.beam_width > 1 else self.params.n
        try:
            async for out in stream:
                if out.error:
                    raise APIError(400, out.error, "prompt")
                now = time.perf_counter()
                if out.events:
                    if self.first_token_at is None:
                        self.first_token_at = now
                        self.metrics.observe_ttft(now - self.started)
                    elif self.last_token_at is not None:
                        self.metrics.observe_itl(now - self.last_token_at)
                    self.last_token_at = now
                    self.num_generated += len(out.events)
                    self.output_ids += [e.token_id for e in out.events
                                        if e.seq_index == 0 and e.token_id not in served.tokenizer.eot_ids]
                for d in assembler.feed(out):
                    if d.finish_reason:
                        self.finish_reasons[d.index] = d.finish_reason
                    yield d
                if not out.finished and self.params.stop and assembler.all_stopped(width):
                    stream.abort()
        except PagedError as e:   # the engine step failed (it fails every request in it)
            raise APIError(500, f"generation failed: {e}", None, "server_error") from None
        finally:
            # normal end, stop string, error or client gone: the pages go back now
            stream.abort()
            served.release()
            self.metrics.inflight[served.name] -= 1
            self.metrics.add_tokens(len(self.prompt_ids), self.num_generated)

    async def collect(self, request) -> list[TextDelta]:
        """Every delta of a non-streamed answer. A client that hangs up while it waits
        has its request aborted (pages freed) instead of run to max_tokens: 499."""
        async def answer():
            return [d async for d in self.deltas()]

        async def hang_up():
            # the body has been read: the next ASGI message is http.disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, gone = asyncio.ensure_future(answer()), asyncio.ensure_future(hang_up())
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            gone.cancel()
            raise
        gone.cancel()
        if work in done:
            return work.result()
        work.cancel()   # deltas() aborts the request as it unwinds
        await asyncio.gather(work, return_exceptions=True)
        raise APIError(499, "the client closed the connection before the answer was ready")

    def durations_ns(self) -> dict:
        """Ollama's timing fields, in nanoseconds."""
        end = time.perf_counter()
        first = self.first_token_at or end
        return {"total_duration": int((end - self.started) * 1e9), "load_duration": int(self.load_seconds * 1e9),
                "prompt_eval_count": len(self.prompt_ids),
                "prompt_eval_duration": int(max(0.0, first - self.started - self.load_seconds) * 1e9),
                "eval_count": self.num_generated, "eval_duration": int((end - first) * 1e9)}


def require_generative(served: ServedModel) -> None:
    """A 400 when a generation route is asked of an embedding-only model."""
    if served.template is None:
        raise APIError(400, f"\"{served.name}\" is an embedding model ({served.config.arch}): it does not "
                       "generate text; use /api/embed or /v1/embeddings", "model")


def request_params(surface: Surface, fields, **overrides) -> SamplingParams:
    """The request's SamplingParams; an invalid field is a 400 that names it."""
    try:
        return sampling_params(surface, fields, **overrides)
    except PagedError as e:
        message = str(e)
        raise APIError(400, message, message.split("'")[1] if "'" in message else None) from None


def fit_prompt(served: ServedModel, prompt_ids: list[int], limits: Limits, truncate: bool = False,
               n_ctx: int | None = None) -> list[int]:
    """The prompt within the context (n_ctx, when a request asks for less than the
    server's): a 400 when too long, or its tail (after BOS) when truncate is set, as
    Ollama does."""
    n_ctx = min(n_ctx or served.n_ctx, served.n_ctx)
    max_prompt = min(limits.max_prompt_tokens or n_ctx, n_ctx - 1)
    if len(prompt_ids) <= max_prompt:
        return prompt_ids
    if not truncate:
        raise APIError(400, f"prompt is {len(prompt_ids)} tokens; the limit is {max_prompt}", "prompt")
    keep = 1 if prompt_ids and prompt_ids[0] == served.tokenizer.bos_id else 0
    return prompt_ids[:keep] + prompt_ids[len(prompt_ids) - (max_prompt - keep):]


def start_generation(served: ServedModel, prompt_ids: list[int], params: SamplingParams,
                     limits: Limits, metrics: Metrics, n_ctx: int | None = None,
                     keep_alive: float | None = None) -> Generation:
    """Check the limits that need the model, then a Generation ready to iterate; n_ctx
    (Ollama's num_ctx) bounds prompt plus answer below the server's context. The
    request's keep_alive (None: the server's, forever) becomes the model's, as the
    last request scheduled sets it in Ollama."""
    prompt_ids = fit_prompt(served, prompt_ids, limits, n_ctx=n_ctx)
    if not prompt_ids:
        raise APIError(400, "prompt is empty", "prompt")
    if params.max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens {params.max_tokens} exceeds the limit {limits.max_tokens}",
                       "max_tokens")
    if n_ctx is not None and n_ctx < served.n_ctx:
        room = n_ctx - len(prompt_ids)
        params.max_tokens = min(params.max_tokens, room) if params.max_tokens else room
    if params.n > limits.max_n or params.beam_width > limits.max_n:
        raise APIError(400, f"n {max(params.n, params.beam_width)} exceeds the limit {limits.max_n}", "n")
    if metrics.inflight[served.name] >= limits.max_queue + served.options.max_num_seqs:
        raise APIError(503, "server busy: the request queue is full, retry shortly", None,
                       "server_busy", {"Retry-After": "1"})
    served.keep_alive = keep_alive
    return Generation(served, prompt_ids, params, metrics)


def final_text(deltas: list[TextDelta], n: int) -> list[str]:
    texts = [""] * n
    for d in deltas:
        if d.index < n:
            texts[d.index] += d.text
    return texts
