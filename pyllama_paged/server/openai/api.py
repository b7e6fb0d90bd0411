"""OpenAI-compatible routes: /v1/models, /v1/models/{id}, /v1/completions,
/v1/chat/completions (structured output, tools, logprobs), and llama-server's
aliases of the OpenAI routes without /v1."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ...calls.chat_call import Answer, AnswerPiece
from ...errors import PagedError
from ..chat import answering_model, prepare_prompt, run_chat, start_prompts
from ..generation import APIError, admit, off_loop
from ..lookup import find_model
from ..state import server_state
from ..sse import OPENAI_DONE, event_stream, openai_error_events, sse
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


async def score(served, ids: list[int], top_n: int, state, lora=None) -> list:
    """A prompt's own log-probabilities (under the LoRA adapter the request picked): a queue
    place like any request, and a scoring request the engine computes a chunk per step beside
    everyone's work."""
    admit(served, state.limits, state.metrics)
    try:
        return await served.score_prompt(ids, top_n, lora)
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
        events = [sse({**head, "choices": [c]}) for c in choices]
        if body.include_usage:
            events.append(sse({**head, "choices": [], "usage": usage}))
        return event_stream(events + [OPENAI_DONE])
    return JSONResponse({**head, "choices": choices, "usage": usage})


def _usage(gens) -> dict:
    prompt = sum(len(g.prompt_ids) for g in gens)
    completion = sum(g.num_generated for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _events(choice_lists, head: dict, gens, include_usage: bool):
    """The SSE body: a chunk per choice as they come, usage if asked, then the end; an
    error after the 200 header is an error event, then the end."""
    try:
        async for choices in choice_lists:
            for c in choices:
                yield sse({**head, "choices": [c]})
    except APIError as e:
        yield openai_error_events(e.message, e.type, e.param, e.code)
        return
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage(gens)})
    yield OPENAI_DONE


def _chat_choice(answer: Answer, logprobs_of) -> dict:
    """A whole answer as a chat completion's choice."""
    message = {"role": "assistant", "content": answer.content}
    finish = answer.finish_reason
    if answer.calls:
        message = {"role": "assistant", "content": answer.content or None,
                   "tool_calls": [c.openai() for c in answer.calls]}
        finish = "tool_calls"
    if answer.thinking:   # vLLM's and llama-server's field for a reasoning model's thinking
        message["reasoning_content"] = answer.thinking
    return {"index": answer.index, "message": message, "logprobs": logprobs_of(answer.events),
            "finish_reason": finish}


def _chat_chunk_choices(piece: AnswerPiece, started: set[int], logprobs_of) -> list[dict]:
    """A piece of a streamed answer as chat chunks' choices: the role with a sample's first
    content, its tool calls, then its finish reason."""
    delta = {"content": piece.text} if piece.text else {}
    if piece.thinking:
        delta = {"reasoning_content": piece.thinking, **delta}
    if piece.index not in started:
        started.add(piece.index)
        delta = {"role": "assistant", **delta}
    lps = logprobs_of([piece.event]) if piece.event is not None else None
    out = []
    if delta or lps:
        out.append({"index": piece.index, "delta": delta, "logprobs": lps, "finish_reason": None})
    if piece.calls:
        out.append({"index": piece.index, "delta": {"tool_calls": [c.openai(k) for k, c in enumerate(piece.calls)]},
                    "logprobs": None, "finish_reason": None})
    if piece.finish_reason:
        out.append({"index": piece.index, "delta": {}, "logprobs": None,
                    "finish_reason": "tool_calls" if piece.calls else piece.finish_reason})
    return out


router = APIRouter()


def _card(m) -> dict:
    return {"id": m.name, "object": "model", "created": int(m.loaded_at), "owned_by": "pyllama-paged"}


def _adapter_card(name: str, served, path: str) -> dict:
    """A LoRA adapter as vLLM lists one: a model whose parent is the model it adapts."""
    return {"id": name, "object": "model", "created": int(served.loaded_at), "owned_by": "pyllama-paged",
            "root": path, "parent": served.name}


@router.get("/v1/models")
async def models(request: Request):
    state = server_state(request)
    stored = await asyncio.to_thread(state.registry.stored_models)
    return {"object": "list", "data": [_card(m) for m in state.registry.models.values()] +
            [_adapter_card(name, served, path) for name, served, path, _ in state.registry.adapter_list()] +
            [{"id": m.name.lower(), "object": "model", "created": int(m.pulled_at), "owned_by": "pyllama-paged"}
             for m in stored]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    registry = server_state(request).registry
    for name, served, path, _ in registry.adapter_list():
        if name == model.lower().removesuffix(":latest"):
            return _adapter_card(name, served, path)
    return _card(await find_model(registry, model))


class LoadLora(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_path: str | None = None


def _lora_runtime(request: Request):
    state = server_state(request)
    if not state.registry.serving.lora_runtime:
        raise APIError(403, "loading and unloading LoRA adapters while serving is off; start the server with "
                       "--lora-runtime", None, code="forbidden")
    return state


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLora, request: Request):
    """vLLM's: load an adapter file as a model name (with --lora-runtime)."""
    state = _lora_runtime(request)
    if not body.lora_path:
        raise APIError(400, "lora_path is required", "lora_path")
    try:
        await state.registry.load_adapter(body.lora_name, body.lora_path)
    except PagedError as e:
        raise APIError(400, str(e), "lora_path") from None
    except ValueError as e:
        raise APIError(400, str(e), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: LoadLora, request: Request):
    """vLLM's: unload an adapter loaded at start or at run time (with --lora-runtime)."""
    state = _lora_runtime(request)
    try:
        await state.registry.unload_adapter(body.lora_name)
    except KeyError:
        raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is loaded", "lora_name") from None
    except PagedError as e:
        raise APIError(409, str(e), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.get("/lora-adapters")
async def lora_adapters(request: Request):
    """llama-server's list of the adapters a request's lora field picks by id."""
    return [{"id": i, "name": name, "path": path, "scale": scale}
            for i, (name, _, path, scale) in enumerate(server_state(request).registry.adapter_list())]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = server_state(request)
    call = body.prompt_call(state.limits.max_prompts)
    served, prepared = await prepare_prompt(state, call)
    tok = served.tokenizer
    ids_of = [p.prompt_ids for p in prepared]
    echo_text = await off_loop(state.prep, lambda: [
        (p if isinstance(p, str) else tok.decode(p, skip_special=True)) if body.echo else "" for p in call.prompts])
    echo_lps = [None] * len(ids_of)
    if body.echo and body.logprobs is not None:
        echo_lps = [await score(served, ids, body.logprobs, state, call.sampling.get("lora")) for ids in ids_of]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": answering_model(served, call.sampling.get("lora"))}
    if body.max_tokens == 0:
        return scored_only(body, head, tok, ids_of, echo_text, echo_lps)
    gens = [run.gen for run in await start_prompts(state, served, call, prepared)]
    if body.stream:
        return event_stream(_events(_completion_chunks(body, gens, tok, echo_text), head, gens,
                                    body.include_usage))
    collected = await asyncio.gather(*(g.collect(request) for g in gens))
    choices = await off_loop(state.prep, _completion_choices, body, gens, tok, collected, echo_text, echo_lps)
    return JSONResponse({**head, "choices": choices, "usage": _usage(gens)})


async def _completion_chunks(body: CompletionRequest, gens, tok, echo_text: list[str]):
    """The streamed choices of the generations, as they come: each prompt's echo before its
    first text, a token's log-probabilities with it."""
    n, echoed = body.n or 1, set()
    async for i, d in _merged(gens):
        index, text = i * n + d.index, d.text
        if body.echo and index not in echoed:
            echoed.add(index)
            text = echo_text[i] + text
        lps = None
        if body.logprobs is not None and d.event is not None:
            lps = completion_logprobs(tok, [], None, [d.event])
        yield [{"index": index, "text": text, "logprobs": lps, "finish_reason": d.finish_reason}] \
            if text or d.finish_reason or lps else []


def _completion_choices(body: CompletionRequest, gens, tok, collected, echo_text, echo_lps) -> list[dict]:
    """Each prompt's n whole choices (log-probabilities formatted here, off the event loop)."""
    n, choices = body.n or 1, []
    for i, deltas in enumerate(collected):
        for j in range(n):
            own = [d for d in deltas if d.index == j]
            lps = None
            if body.logprobs is not None:
                lps = completion_logprobs(tok, gens[i].prompt_ids if body.echo else [], echo_lps[i],
                                          [d.event for d in own if d.event is not None])
            choices.append({"index": i * n + j, "text": echo_text[i] + "".join(d.text for d in own),
                            "logprobs": lps, "finish_reason": gens[i].finish_reasons.get(j, "length")})
    return choices


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    state = server_state(request)
    run = await run_chat(state, body.chat_call())
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": run.model_name}
    tok = run.served.tokenizer

    def logprobs_of(events):
        return chat_logprobs(tok, events) if body.logprobs else None

    if body.stream:
        async def choice_lists():
            started: set[int] = set()
            async for piece in run.pieces():
                yield _chat_chunk_choices(piece, started, logprobs_of)
        return event_stream(_events(choice_lists(), head, [run.gen], body.include_usage))
    answers = await run.answers(request)
    choices = await off_loop(state.prep, lambda: [_chat_choice(a, logprobs_of) for a in answers])
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": _usage([run.gen])})


add_unversioned(router)
