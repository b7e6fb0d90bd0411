"""Ollama-compatible routes: /api/generate, /api/chat, /api/tags, /api/show, /api/ps, /api/version."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .._version import __version__
from ..errors import PagedError
from ..engine.sampler import SamplingParams
from ..sampling_options import OLLAMA
from .generation import APIError, request_params, start_generation


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, gt=0)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    stream: bool = True
    options: Options | None = None
    images: list[str] | None = None
    context: list[int] | None = None   # a previous answer's context: continue that exchange


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    images: list[str] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    messages: list[Message]
    stream: bool = True
    options: Options | None = None


class NameRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    name: str | None = None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _params(options: Options | None, default_max: int) -> SamplingParams:
    return request_params(OLLAMA, (options or Options()).model_dump(), max_tokens=default_max)


def build_router(state) -> APIRouter:
    router = APIRouter()

    def find(name: str):
        served = state.registry.get(name)
        if served is None:
            raise APIError(404, f"model '{name}' not found; available: {', '.join(state.registry.names())}",
                           "model", "not_found")
        return served

    async def respond(gen, request: Request, stream: bool, shape):
        """NDJSON stream of shape(text, done) objects, or one object when stream is false."""
        if stream:
            async def lines():
                try:
                    async for d in gen.deltas():
                        if d.index == 0 and d.text:
                            yield json.dumps(shape(d.text, False)) + "\n"
                except APIError as e:   # after the 200 header: end the stream with Ollama's error line
                    yield json.dumps({"error": e.message}) + "\n"
                    return
                yield json.dumps(final(gen, shape)) + "\n"
            return StreamingResponse(lines(), media_type="application/x-ndjson")
        text = "".join(d.text for d in await gen.collect(request) if d.index == 0)
        body = final(gen, shape)
        body.update({k: v for k, v in shape(text, True).items() if k in ("response", "message")})
        return JSONResponse(body)

    def final(gen, shape):
        body = shape("", True)
        body["done_reason"] = gen.finish_reasons.get(0, "stop")
        body.update(gen.durations_ns())
        return body

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request):
        served = find(body.model)
        if body.images:
            raise APIError(400, "images are not supported by this model", "images")
        if body.raw:
            text = body.prompt
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                       [{"role": "user", "content": body.prompt}]
            text = served.template.render(messages) if body.prompt else ""
        if not body.prompt:   # Ollama answers an empty prompt by loading the model
            return JSONResponse({"model": body.model, "created_at": _now(), "response": "",
                                 "done": True, "done_reason": "load"})
        ids = list(body.context or []) + \
            served.tokenizer.encode(text, add_special=not body.context, parse_special=not body.raw)
        params = _params(body.options, min(512, state.limits.max_tokens))  # a default within the limit
        gen = start_generation(served, ids, params, state.limits, state.metrics)

        def shape(text, done):
            out = {"model": body.model, "created_at": _now(), "response": text, "done": done}
            if done:   # Ollama's token context of this exchange (prompt + response)
                out["context"] = gen.prompt_ids + gen.output_ids
            return out
        return await respond(gen, request, body.stream, shape)

    @router.post("/api/chat")
    async def chat(body: ChatRequest, request: Request):
        served = find(body.model)
        if any(m.images for m in body.messages):
            raise APIError(400, "images are not supported by this model", "messages")
        try:
            text = served.template.render([m.model_dump(include={"role", "content"}) for m in body.messages])
        except PagedError as e:
            raise APIError(400, str(e), "messages") from None
        ids = served.tokenizer.encode(text, add_special=True, parse_special=True)
        params = _params(body.options, min(512, state.limits.max_tokens))  # a default within the limit
        gen = start_generation(served, ids, params, state.limits, state.metrics)
        shape = lambda text, done: {"model": body.model, "created_at": _now(),
                                    "message": {"role": "assistant", "content": text}, "done": done}
        return await respond(gen, request, body.stream, shape)

    def describe(served) -> dict[str, Any]:
        return {"name": served.name, "model": served.name,
                "modified_at": dt.datetime.fromtimestamp(served.loaded_at, dt.timezone.utc).isoformat(),
                "size": served.size, "digest": served.digest, "details": served.details()}

    @router.get("/api/tags")
    async def tags():
        return {"models": [describe(m) for m in state.registry.models.values()]}

    @router.post("/api/show")
    async def show(body: NameRequest):
        served = find(body.model or body.name or "")
        cfg = served.model.config
        info = {k: v.encode("utf-8", "replace").decode("utf-8") if isinstance(v, str) else v
                for k, v in served.model.metadata.items()
                if not k.startswith("tokenizer.ggml.") and isinstance(v, (str, int, float, bool))}
        return {"modelfile": f"FROM {served.path}\n", "parameters": "", "template": served.template.source,
                "details": served.details(), "model_info": info,
                "capabilities": ["completion"],
                "kv_bytes_per_token": served.runner.kv_bytes_per_token,
                "context_length": served.n_ctx, "architecture": cfg.arch}

    @router.get("/api/ps")
    async def ps():
        models = []
        for served in state.registry.models.values():
            stats = await asyncio.to_thread(served.loop.call, lambda llm: llm.stats())
            kv_bytes = served.runner.kv_bytes_per_token * served.runner.kv.num_blocks * \
                served.runner.kv.block_size
            models.append({**describe(served), "expires_at": "0001-01-01T00:00:00Z",
                           "size_vram": 0, "context_length": served.n_ctx,
                           "kv_cache": {"bytes": kv_bytes, "paged": served.runner.kv.paged, **stats}})
        return {"models": models}

    @router.get("/api/version")
    async def version():
        return {"version": __version__}

    return router
