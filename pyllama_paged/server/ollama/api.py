"""Ollama-compatible generation routes: /api/generate and /api/chat (format,
tools, think, keep_alive, truncate, num_ctx), /api/show and /api/version."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ...calls.chat_call import ChatCall, PromptCall, split_as_streamed
from ...calls.sampling_options import OLLAMA
from ...constrain.formats import from_ollama
from ...tools.reasoning import template_thinks
from ..chat import ChatRun, check_call, run_prompt, start_chat
from ..generation import APIError
from ..keep_alive import keep_alive_seconds
from ..lookup import find_model
from ..state import server_state
from ..tool_schema import ToolFunction
from .manage import OLLAMA_VERSION, NameRequest, describe, describe_stored, show_model


class Options(BaseModel):
    # strict: the types the schema says (true is not the integer 1, "5" is not a number)
    model_config = ConfigDict(extra="ignore", strict=True)
    num_predict: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, gt=0)
    speculative: bool | None = None   # ours: false opts this request out of speculative decoding
    # Ollama samplers we do not have: accepted at their neutral values, a 400 otherwise
    mirostat: int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None

    def refuse_unsupported(self) -> None:
        """A 400 for a sampler we do not have, rather than silently sampling without it."""
        for name, neutral in (("mirostat", 0), ("typical_p", 1.0), ("tfs_z", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise APIError(400, f"options.{name} {value} is not supported (only {neutral})", f"options.{name}")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    stream: bool | None = True
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    truncate: bool | None = True


class GenerateRequest(_Common):
    prompt: str | None = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool | None = False
    images: list[str] | None = None
    context: list[int] | None = None   # a previous answer's context: continue that exchange


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Loose):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Loose):
    function: FunctionCall


class Message(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class Tool(_Loose):
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatRequest(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _sampling(options: Options) -> dict[str, Any]:
    """The sampling fields of options, as SamplingParams names them."""
    fields = options.model_dump(exclude={"mirostat", "typical_p", "tfs_z"})
    if fields.pop("repeat_last_n", None) is not None:
        last_n = options.repeat_last_n
        fields["penalty_last_n"] = 0 if last_n == -1 else last_n   # -1: the whole context
    return fields


# Ollama's think efforts (gpt-oss's): any of them turns thinking on for a model that has one switch
THINK_LEVELS = ("high", "medium", "low")


def _think_switch(think) -> bool | None:
    """Ollama's think (true/false, or an effort: "high", "medium", "low") as the template's
    enable_thinking; None leaves the template's default."""
    if think is None:
        return None
    return think not in (False, "false", "none", "")


def _think_level(think) -> str | None:
    """Ollama's think as gpt-oss's reasoning_effort: an effort as sent; true and false leave
    the template's default, as Ollama does for gpt-oss."""
    return think if think in THINK_LEVELS else None


def _refuse_think(body: _Common, served) -> None:
    """A 400 for think on a model that cannot, or for a think that is no switch nor effort."""
    if _think_switch(body.think) and not template_thinks(served.template.source):
        raise APIError(400, f"\"{served.name}\" does not support thinking", "think")
    if isinstance(body.think, str) and body.think not in THINK_LEVELS + ("true", "false", "none", ""):
        raise APIError(400, f"think must be true, false or one of {', '.join(THINK_LEVELS)}, not {body.think!r}",
                       "think")


def _chat_call(body: ChatRequest) -> ChatCall:
    """/api/chat's request as the server's chat path takes it (an unset num_predict: the server's cap)."""
    options = body.options or Options()

    def refuse(served) -> None:
        _refuse_think(body, served)
        options.refuse_unsupported()

    return ChatCall(
        messages=[m.model_dump(exclude_none=True, exclude={"thinking"}) for m in body.messages],
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        structured=lambda tokenizer: from_ollama(tokenizer, body.format), surface=OLLAMA,
        sampling=_sampling(options), truncate=body.truncate is not False, model=body.model, thinking=_think_switch(body.think),
        reasoning_effort=_think_level(body.think),
        limit_fields={"stop": options.stop, "messages": body.messages, "tools": body.tools,
                      "grammars": {"format": body.format}},
        refuse_unsupported=refuse, n_ctx=options.num_ctx, keep_alive=body.keep_alive)


def _prompt_call(body: GenerateRequest) -> PromptCall:
    """/api/generate's request as the server's prompt path takes it: the prompt through the
    model's template after the system prompt, or as given (raw), after the context of an
    earlier exchange (an unset num_predict: the server's cap)."""
    options = body.options or Options()

    def refuse(served) -> None:
        _refuse_think(body, served)
        options.refuse_unsupported()
        keep_alive_seconds(body.keep_alive)
        for name, given, why in (("images", body.images if served.vision is None else None,
                                  "images are not supported by this model"),
                                 ("suffix", body.suffix, "suffix (fill-in-the-middle) is not supported by this model"),
                                 ("template", body.template, "a per-request template is not supported; use raw "
                                                             "with a formatted prompt")):
            if given:
                raise APIError(400, why, name)

    return PromptCall(
        prompts=[body.prompt or ""], templated=not body.raw, system=body.system, context=list(body.context or []),
        images=list(body.images or []),
        structured=lambda tokenizer: from_ollama(tokenizer, body.format), structured_param="format", surface=OLLAMA,
        sampling=_sampling(options), truncate=body.truncate is not False, model=body.model,
        thinking=_think_switch(body.think), reasoning_effort=_think_level(body.think),
        limit_fields={"stop": options.stop, "grammars": {"format": body.format}}, refuse_unsupported=refuse,
        n_ctx=options.num_ctx, keep_alive=body.keep_alive)


router = APIRouter()


async def _after(served) -> None:
    """keep_alive 0 (this request's or a later one's) drops the engine now unless other
    requests hold it; then the expiry watcher drops it when the last one ends."""
    if served.keep_alive == 0:
        await served.unload_if_idle()


async def _load_only(body: _Common, served, keep_alive) -> JSONResponse:
    """Ollama's answer to an empty prompt or chat: the model loaded (or unloaded, keep_alive 0)."""
    served.keep_alive = keep_alive
    if keep_alive != 0:
        await served.acquire()
        served.release()
    await _after(served)
    shape = {"model": body.model, "created_at": _now(), "done": True,
             "done_reason": "unload" if keep_alive == 0 else "load"}
    return JSONResponse({**shape, "response": ""} if isinstance(body, GenerateRequest) else
                        {**shape, "message": {"role": "assistant", "content": ""}})


def _final(gen, shape) -> dict:
    body = shape("", True)
    body["done_reason"] = gen.finish_reasons.get(0, "stop")
    body.update(gen.durations_ns())
    return body


async def _lines(run: ChatRun, shape):
    """The NDJSON stream: shape(text, False, calls, thinking) as the answer comes, then the
    final object; an error after the 200 header ends it with Ollama's error line."""
    try:
        async for piece in run.pieces():
            if piece.index == 0 and (piece.text or piece.calls or piece.thinking):
                yield json.dumps(shape(piece.text, False, piece.calls, piece.thinking)) + "\n"
    except APIError as e:
        yield json.dumps({"error": e.message}) + "\n"
        return
    finally:
        await _after(run.served)
    yield json.dumps(_final(run.gen, shape)) + "\n"


async def _respond(run: ChatRun, request: Request, body: _Common, shape):
    """NDJSON stream of shape(text, done, calls) objects, or one object when stream is false."""
    if body.stream is not False:
        return StreamingResponse(_lines(run, shape), media_type="application/x-ndjson")
    try:
        # text a stream lets through before a tool call stays content, as it would have streamed
        answer = (await run.answers(request, split_as_streamed))[0]
    finally:
        await _after(run.served)
    out = _final(run.gen, shape)
    whole = shape(answer.content, True, answer.calls, answer.thinking)
    out.update({k: v for k, v in whole.items() if k in ("response", "message", "thinking")})
    return JSONResponse(out)


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request):
    state, call = server_state(request), _prompt_call(body)
    if not body.prompt:   # Ollama answers an empty prompt by loading (or unloading) the model
        return await _load_only(body, await check_call(state, call), keep_alive_seconds(body.keep_alive))
    [run] = await run_prompt(state, call)

    def shape(text, done, calls=None, thinking=""):
        out = {"model": body.model, "created_at": _now(), "response": text, "done": done}
        if thinking:
            out["thinking"] = thinking
        if done:   # Ollama's token context of this exchange (prompt + response)
            out["context"] = run.gen.prompt_ids + run.gen.output_ids
        return out
    return await _respond(run, request, body, shape)


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request):
    state, call = server_state(request), _chat_call(body)
    served = await check_call(state, call)
    keep_alive = keep_alive_seconds(body.keep_alive)
    if not body.messages:   # Ollama loads (or unloads) the model for an empty chat
        return await _load_only(body, served, keep_alive)
    run = await start_chat(state, served, call)

    def shape(text, done, calls=None, thinking=""):
        message = {"role": "assistant", "content": text}
        if thinking:   # Ollama's field for a thinking model's thinking, apart from the answer
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [c.ollama() for c in calls]
        return {"model": body.model, "created_at": _now(), "message": message, "done": done}
    return await _respond(run, request, body, shape)


@router.post("/api/show")
async def show(body: NameRequest, request: Request):
    return show_model(await find_model(server_state(request).registry, body.model or body.name or ""))


@router.get("/api/tags")
async def tags(request: Request):
    registry = server_state(request).registry
    # the store is read on a thread: a listing never holds the loop on a slow disk
    stored = await asyncio.to_thread(registry.stored_models)
    return {"models": [describe(m) for m in registry.models.values()] +
                      [describe(registry.models[t], alias) for alias, t in registry.aliases.items()] +
                      [describe(served, name) for name, served, _, _ in registry.adapter_list()] +
                      [describe_stored(m) for m in stored]}


@router.get("/api/ps")
async def ps(request: Request):
    state = server_state(request)
    # an unloaded model is not running: /api/ps lists loaded models only, as Ollama's
    loaded = [m for m in state.registry.models.values() if m.is_loaded]
    # read together: a busy engine costs one timeout (then its last figures), not one each
    found = await asyncio.gather(*(m.figures(state.limits.stats_timeout) for m in loaded))
    models = []
    for served, (figures, current) in zip(loaded, found):
        if figures is None and not served.is_loaded:   # dropped meanwhile
            continue
        entry = {**describe(served), "expires_at": served.expires_at(),
                 "size_vram": served.size_vram(figures), "context_length": served.n_ctx}
        if figures is not None:
            entry["kv_cache"] = {"bytes": figures["kv_pool_bytes"], "paged": figures["paged"],
                                 **figures["stats"], "current": current}
        models.append(entry)
    return {"models": models}


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_VERSION}
