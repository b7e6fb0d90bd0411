"""One generation as the HTTP handlers run it: limits, admission, submission to
the model's engine loop, text assembly, timing, and abort on disconnect."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from ..engine import SamplingParams
from ..errors import PagedError
from ..calls.sampling_options import Surface, sampling_params
from ..calls.text_stream import TextAssembler, TextDelta
from ..flags import flag_of
from .config import Limits
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


def limit_flag(name: str) -> str:
    """The `serve` option that sets Limits field `name`."""
    return flag_of(Limits, name)


def refuse_over(limits: Limits, name: str, value: int, what: str, param: str | None,
                status: int = 400) -> None:
    """An error naming the limit and the option that raises it when value exceeds limits.<name>."""
    limit = getattr(limits, name)
    if limit is not None and value > limit:
        raise APIError(status, f"{what} is {value}; the limit is {limit} (the server's {limit_flag(name)} option)",
                       param, code="limit_exceeded")


def json_depth(value: Any, stop_after: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion (a deep
    value must not blow the stack); stops counting past stop_after."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_json(limits: Limits, value: Any, size_limit: str, what: str, param: str) -> None:
    refuse_over(limits, "max_schema_depth", json_depth(value, limits.max_schema_depth),
                f"the nesting depth of {what}", param)
    # within the depth limit json.dumps cannot recurse too deeply
    size = len(value.encode()) if isinstance(value, str) else \
        len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    refuse_over(limits, size_limit, size, f"the size of {what} in bytes", param)


def check_request(limits: Limits, *, stop: Any = None, messages: list | None = None, tools: list | None = None,
                  logit_bias: dict | None = None, grammars: dict[str, Any] | None = None) -> None:
    """The per-request limits, checked before any work (tokenizing, rendering, compiling):
    a 400 that names the limit and the option that raises it."""
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else list(stop)
        refuse_over(limits, "max_stop", len(stops), "the number of stop strings", "stop")
        longest = max((len(s) for s in stops), default=0)
        refuse_over(limits, "max_stop_chars", longest, "the length of a stop string", "stop")
    if messages is not None:
        refuse_over(limits, "max_messages", len(messages), "the number of messages", "messages")
    if tools:
        refuse_over(limits, "max_tools", len(tools), "the number of tools", "tools")
        dumped = [t.model_dump(exclude_none=True, by_alias=True) if hasattr(t, "model_dump") else t for t in tools]
        _check_json(limits, dumped, "max_tools_bytes", "tools", "tools")
    if logit_bias:
        refuse_over(limits, "max_logit_bias", len(logit_bias), "the number of logit_bias entries", "logit_bias")
    for param, value in (grammars or {}).items():
        if value is not None:
            _check_json(limits, value, "max_grammar_bytes", param, param)


async def off_loop(pool: Executor, fn, *args):
    """fn(*args) on the server's bounded worker pool: tokenizing, rendering and parsing
    never run on the event loop (which would stall every route) nor on the loop's
    default pool (which every route shares)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
    except RecursionError:   # json or a template walking a value nested too deeply
        raise APIError(400, "the request is nested too deeply to be processed") from None


def admit(served: ServedModel, limits: Limits, metrics: Metrics) -> None:
    """Take one of the model's places (running or queued) now, or a 503. The check and the
    count are one step with no await between, so a burst cannot overshoot the limit."""
    if not metrics.admit(served.name, limits.max_queue + served.serving.engine.scheduler.max_num_seqs):
        raise APIError(503, "server busy: the request queue is full, retry shortly", None,
                       "server_busy", {"Retry-After": "1"})


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
    images: list = field(default_factory=list)   # (first position, EncodedImage) per image in the prompt
    admitted: bool = False      # holds one of the model's queue places (see admit)

    def leave(self) -> None:
        """Give back the queue place (once, however the request ends)."""
        if self.admitted:
            self.admitted = False
            self.metrics.leave(self.served.name)

    def __del__(self):
        # a generation dropped before it was iterated (a later prompt of its request was
        # refused, the client left before the body started) must not keep its place forever
        self.leave()

    async def deltas(self):
        """Async iterator of TextDelta; aborts the request if the consumer goes away."""
        served = self.served
        try:
            self.load_seconds = await served.acquire()
        except BaseException:
            self.leave()
            raise
        try:
            stream = served.loop.submit(self.prompt_ids, self.params, images=self.images)
        except BaseException:
            served.release()
            self.leave()
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
                        self.metrics.observe_ttft(now - self.started, served.name)
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
            self.leave()
            self.metrics.add_tokens(len(self.prompt_ids), self.num_generated, served.name)
            self.metrics.observe_e2e(served.name, time.perf_counter() - self.started)

    async def collect(self, request, deltas=None) -> list[TextDelta]:
        """Every delta of a non-streamed answer (of deltas, an iterator over this generation's
        that may end it early; None: all of them). A client that hangs up while it waits
        has its request aborted (pages freed) instead of run to max_tokens: 499."""
        async def answer():
            return [d async for d in (self.deltas() if deltas is None else deltas)]

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


def field_error(e: PagedError) -> APIError:
    """The 400 for an invalid sampling field, naming the field its message quotes."""
    message = str(e)
    return APIError(400, message, message.split("'")[1] if "'" in message else None)


def request_params(surface: Surface, fields, **overrides) -> SamplingParams:
    """The request's SamplingParams; an invalid field is a 400 that names it."""
    try:
        return sampling_params(surface, fields, **overrides)
    except PagedError as e:
        raise field_error(e) from None


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
        by = (f"the server's {limit_flag('max_prompt_tokens')} option" if max_prompt == limits.max_prompt_tokens
              else "the context, less one token for the answer")
        raise APIError(400, f"prompt is {len(prompt_ids)} tokens; the limit is {max_prompt} ({by})", "prompt")
    keep = 1 if prompt_ids and prompt_ids[0] == served.tokenizer.bos_id else 0
    return prompt_ids[:keep] + prompt_ids[len(prompt_ids) - (max_prompt - keep):]


def start_generation(served: ServedModel, prompt_ids: list[int], params: SamplingParams,
                     limits: Limits, metrics: Metrics, n_ctx: int | None = None,
                     keep_alive: float | None = None, images=()) -> Generation:
    """Check the limits that need the model, then a Generation ready to iterate; n_ctx
    (Ollama's num_ctx) bounds prompt plus answer below the server's context. The
    request's keep_alive (None: the server's, forever) becomes the model's, as the
    last request scheduled sets it in Ollama. images: the prompt's, placed by prepare_call."""
    if images and served.vision is None:   # never reached through the APIs' checks
        raise APIError(400, "images are not supported by this model", None)
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
    admit(served, limits, metrics)
    served.keep_alive = keep_alive
    return Generation(served, prompt_ids, params, metrics, admitted=True, images=list(images))


def final_text(deltas: list[TextDelta], n: int) -> list[str]:
    texts = [""] * n
    for d in deltas:
        if d.index < n:
            texts[d.index] += d.text
    return texts
