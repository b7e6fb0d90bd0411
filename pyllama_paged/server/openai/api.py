"""OpenAI-compatible routes: /v1/models, /v1/models/{id}, /v1/completions,
/v1/chat/completions (structured output, tools, logprobs), and llama-server's
aliases of the OpenAI routes without /v1."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, StreamingResponse

from ...errors import PagedError
from ...tools.calls import ToolCallStream, parse_tool_calls
from ...tools.messages import normalize_messages
from ...tools.prompt import prepare_chat
from ..generation import APIError, admit, check_request, fit_prompt, off_loop, require_generative, start_generation
from .logprobs import chat_logprobs, completion_logprobs
from .schemas import ChatRequest, CompletionRequest


# llama-server answers these without /v1 too, and clients post there (dspy's Ollama
# provider to /chat/completions): the same handlers, left out of the OpenAPI schema so
# that it documents each operation once
UNVERSIONED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/models/{model:path}")


def is_unversioned_openai(path: str) -> bool:
    """Whether path is one of the OpenAI routes served without /v1 (its errors take OpenAI's shape)."""
    return path in ("/chat/completions", "/completions", "/embeddings", "/models") or path.startswith("/models/")


def add_unversioned(router: APIRouter) -> APIRouter:
    """router with each of its UNVERSIONED routes served also at its path less /v1."""
    paths = {getattr(r, "path", None) for r in router.routes}
    for route in list(router.routes):
        if isinstance(route, APIRoute) and route.path in UNVERSIONED and route.path[3:] not in paths:
            router.add_api_route(route.path[3:], route.endpoint, methods=list(route.methods),
                                 response_model=route.response_model, status_code=route.status_code,
                                 response_class=route.response_class, include_in_schema=False,
                                 name=f"{route.name}_unversioned")
    return router


def _sse(obj) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


async def _merged(gens):
    """(generation index, delta) from several generations as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for d in gen.deltas():
                await queue.put((i, d))
        except BaseException as e:   # handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def score(served, ids: list[int], top_n: int, state) -> list:
    """A prompt's own log-probabilities: a queue place like any request, and a scoring
    request the engine computes a chunk per step beside everyone's work."""
    admit(served, state.limits, state.metrics)
    try:
        return await served.score_prompt(ids, top_n)
    except PagedError as e:
        raise APIError(503, f"no room to score the prompt now: {e}", "prompt", "server_busy") from None
    finally:
        state.metrics.leave(served.name)


def scored_only(body, head: dict, tok, ids_of, echo_text, echo_lps):
    """max_tokens 0 with echo: each prompt back with its token log-probabilities, nothing generated."""
    n = body.n or 1
    choices = [{"index": i * n + j, "text": echo_text[i], "finish_reason": "length",
                "logprobs": completion_logprobs(tok, ids, echo_lps[i], []) if body.logprobs is not None else None}
               for i, ids in enumerate(ids_of) for j in range(n)]
    prompt_tokens = sum(len(ids) for ids in ids_of)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    if body.stream:
        events = [_sse({**head, "choices": [c]}) for c in choices]
        if body.include_usage:
            events.append(_sse({**head, "choices": [], "usage": usage}))
        return StreamingResponse(iter(events + ["data: [DONE]\n\n"]), media_type="text/event-stream")
    return JSONResponse({**head, "choices": choices, "usage": usage})


async def find_model(state, name: str):
    """The served model of that name (a stored one loaded on first use), or OpenAI's 404
    listing the ones there are."""
    served = await state.registry.resolve(name)
    if served is None:
        raise APIError(404, f"The model '{name}' does not exist; available: "
                       f"{', '.join(state.registry.names())}", "model", code="model_not_found")
    return served


def build_router(state) -> APIRouter:
    router = APIRouter()

    async def find(name: str):
        return await find_model(state, name)

    def card(m) -> dict:
        return {"id": m.name, "object": "model", "created": int(m.loaded_at), "owned_by": "pyllama-paged"}

    @router.get("/v1/models")
    async def models():
        stored = await asyncio.to_thread(state.registry.stored_models)
        return {"object": "list", "data": [card(m) for m in state.registry.models.values()] +
                [{"id": m.name.lower(), "object": "model", "created": int(m.pulled_at), "owned_by": "pyllama-paged"}
                 for m in stored]}

    @router.get("/v1/models/{model:path}")
    async def model(model: str):
        return card(await find(model))

    def usage(gens) -> dict:
        prompt = sum(len(g.prompt_ids) for g in gens)
        completion = sum(g.num_generated for g in gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def respond(gens, request: Request, body, head: dict, choice, chunk_choices, final_chunks):
        """One answer for all generations: SSE chunks, or one JSON body with every choice."""
        n = body.n or 1
        if body.stream:
            async def events():
                try:
                    async for i, d in _merged(gens):
                        for c in await chunk_choices(i * n + d.index, d):
                            yield _sse({**head, "choices": [c]})
                    for c in final_chunks():
                        yield _sse({**head, "choices": [c]})
                except APIError as e:   # after the 200 header: an error event, then the end
                    error = {"message": e.message, "type": e.type, "param": e.param, "code": e.code}
                    yield _sse({"error": error})
                    yield "data: [DONE]\n\n"
                    return
                if body.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(gens)})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        collected = await asyncio.gather(*(g.collect(request) for g in gens))

        def every_choice():
            return [choice(i * n + j, i, [d for d in deltas if d.index == j], gen.finish_reasons.get(j, "length"))
                    for i, (gen, deltas) in enumerate(zip(gens, collected)) for j in range(n)]

        choices = await off_loop(state.prep, every_choice)   # tool calls parsed, log-probs formatted
        return JSONResponse({**head, "object": head["object"].replace(".chunk", ""), "choices": choices,
                             "usage": usage(gens)})

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(state.limits, stop=body.stop, logit_bias=body.logit_bias, grammars=body.grammars())
        served = await find(body.model)
        require_generative(served)
        body.refuse_unsupported(served.config.n_vocab)
        if body.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported by this model", "suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise APIError(400, "best_of is not supported (use n)", "best_of")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is empty", "prompt")
        if len(prompts) > state.limits.max_prompts:
            raise APIError(400, f"{len(prompts)} prompts; the limit is {state.limits.max_prompts}", "prompt")
        n_vocab = served.config.n_vocab

        def tokenized():
            ids_of = []
            for p in prompts:
                if isinstance(p, str):
                    ids_of.append(served.tokenizer.encode(p, add_special=True, parse_special=True))
                elif any(not 0 <= t < n_vocab for t in p):
                    raise APIError(400, "prompt token id outside the vocabulary", "prompt")
                else:
                    ids_of.append(list(p))
            return ids_of

        ids_of = await off_loop(state.prep, tokenized)   # a long prompt: never on the event loop
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is only allowed with echo, to score the prompt",
                           "max_tokens")
        ids_of = [fit_prompt(served, ids, state.limits) for ids in ids_of]
        if not all(ids_of):
            raise APIError(400, "prompt is empty", "prompt")
        echo_text = await off_loop(state.prep, lambda: [
            (p if isinstance(p, str) else served.tokenizer.decode(p, skip_special=True)) if body.echo else ""
            for p in prompts])
        echo_lps = [None] * len(ids_of)
        if body.echo and body.logprobs is not None:
            echo_lps = [await score(served, ids, body.logprobs, state) for ids in ids_of]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served.name}
        tok = served.tokenizer
        if body.max_tokens == 0:
            return scored_only(body, head, tok, ids_of, echo_text, echo_lps)
        try:   # off the event loop: a first grammar prepares the vocabulary (about a second)
            constraint = await off_loop(state.prep, body.constraint, tok)
        except PagedError as e:
            raise APIError(400, str(e)) from None
        gens = []
        try:
            for ids in ids_of:
                gens.append(start_generation(served, ids, body.params(min(16, state.limits.max_tokens),
                                                                      body.logprobs, constraint),
                                             state.limits, state.metrics))
        except BaseException:   # a later prompt refused (queue full): the earlier ones give their places back
            for gen in gens:
                gen.leave()
            raise

        def choice(index, i, deltas, finish):
            lps = None
            if body.logprobs is not None:
                lps = completion_logprobs(tok, gens[i].prompt_ids if body.echo else [], echo_lps[i],
                                          [d.event for d in deltas if d.event is not None])
            return {"index": index, "text": echo_text[i] + "".join(d.text for d in deltas),
                    "logprobs": lps, "finish_reason": finish}

        echoed: set[int] = set()

        async def chunk_choices(index, d):
            text = d.text
            if body.echo and index not in echoed:
                echoed.add(index)
                text = echo_text[index // (body.n or 1)] + text
            lps = None
            if body.logprobs is not None and d.event is not None:
                lps = completion_logprobs(tok, [], None, [d.event])
            if text or d.finish_reason or lps:
                return [{"index": index, "text": text, "logprobs": lps, "finish_reason": d.finish_reason}]
            return []

        return await respond(gens, request, body, head, choice, chunk_choices, lambda: [])

    @router.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_request(state.limits, stop=body.stop, logit_bias=body.logit_bias, messages=body.messages,
                      tools=body.tools, grammars=body.grammars())
        served = await find(body.model)
        require_generative(served)
        body.refuse_unsupported(served.config.n_vocab)
        def prepare():
            messages = normalize_messages([m.model_dump(exclude_none=True) for m in body.messages])
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text, constraint, names = prepare_chat(served.template, served.tokenizer, messages, tools,
                                                   body.tool_choice, body.constraint(served.tokenizer))
            return served.tokenizer.encode(text, add_special=True, parse_special=True), constraint, names

        try:   # off the event loop: a first grammar prepares the vocabulary (about a second)
            ids, constraint, names = await off_loop(state.prep, prepare)
        except PagedError as e:
            raise APIError(400, str(e), "messages" if "messages" in str(e) else None) from None
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.params(state.limits.max_tokens, top, constraint)   # unset: to the context
        gen = start_generation(served, ids, params, state.limits, state.metrics)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": served.name}
        tok = served.tokenizer

        def choice(index, _, deltas, finish):
            text = "".join(d.text for d in deltas)
            message = {"role": "assistant", "content": text}
            if names:
                content, calls = parse_tool_calls(text, names)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.openai() for c in calls]}
                    finish = "tool_calls"
            lps = chat_logprobs(tok, [d.event for d in deltas if d.event is not None]) if body.logprobs else None
            return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish}

        started: set[int] = set()
        streams: dict[int, ToolCallStream] = {}

        async def chunk_choices(index, d):
            text = d.text
            out = []
            if names:
                stream = streams.setdefault(index, ToolCallStream(names))
                text = stream.feed(text)
                if d.finish_reason:
                    rest, calls = await off_loop(state.prep, stream.finish)
                    text += rest
                    if calls:
                        out.append({"tool_calls": [c.openai(k) for k, c in enumerate(calls)]})
            delta = {"content": text} if text else {}
            if index not in started:
                started.add(index)
                delta = {"role": "assistant", **delta}
            lps = chat_logprobs(tok, [d.event]) if body.logprobs and d.event is not None else None
            chunks = []
            if delta or lps:
                chunks.append({"index": index, "delta": delta, "logprobs": lps, "finish_reason": None})
            for extra in out:
                chunks.append({"index": index, "delta": extra, "logprobs": None, "finish_reason": None})
            if d.finish_reason:
                finish = "tool_calls" if out else d.finish_reason
                chunks.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
            return chunks

        return await respond([gen], request, body, head, choice, chunk_choices, lambda: [])

    return add_unversioned(router)
