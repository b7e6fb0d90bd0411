"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import PagedError
from ..engine.sampler import SamplingParams
from ..sampling_options import OPENAI
from .generation import APIError, final_text, request_params, start_generation


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    # strict: the types the schema says (true is not the integer 1, "5" is not a number)
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = False   # llama-server's and vLLM's extension: generate to max_tokens

    def params(self, max_tokens_default: int) -> SamplingParams:
        return request_params(OPENAI, self.model_dump(exclude={"logprobs", "max_completion_tokens"}),
                              max_tokens=max_tokens_default)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def build_router(state) -> APIRouter:
    router = APIRouter()

    def find(name: str):
        served = state.registry.get(name)
        if served is None:
            raise APIError(404, f"The model '{name}' does not exist; available: "
                           f"{', '.join(state.registry.names())}", "model", "model_not_found")
        return served

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": int(m.loaded_at),
                                             "owned_by": "pyllama-paged"} for m in state.registry.models.values()]}

    async def run(gen, request: Request, n: int, stream: bool, include_usage: bool, make_choice, make_delta,
                  obj: str):
        rid, created = f"{'chatcmpl' if 'chat' in obj else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": obj, "created": created, "model": gen.served.name}

        def usage():
            return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": gen.num_generated,
                    "total_tokens": len(gen.prompt_ids) + gen.num_generated}

        if stream:
            async def events():
                try:
                    async for d in gen.deltas():
                        if d.text or d.finish_reason:
                            yield "data: " + json.dumps({**head, "choices": [make_delta(d)]}) + "\n\n"
                except APIError as e:   # after the 200 header: an error event, then the end
                    error = {"message": e.message, "type": e.type, "param": e.param, "code": None}
                    yield "data: " + json.dumps({"error": error}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if include_usage:
                    yield "data: " + json.dumps({**head, "choices": [], "usage": usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        deltas = await gen.collect(request)
        texts = final_text(deltas, n)
        obj_final = obj.replace(".chunk", "")
        return JSONResponse({**head, "object": obj_final,
                             "choices": [make_choice(j, texts[j], gen.finish_reasons.get(j, "length"))
                                         for j in range(n)],
                             "usage": usage()})

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served = find(body.model)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            body.prompt = body.prompt[0]
        if isinstance(body.prompt, str):
            ids = served.tokenizer.encode(body.prompt, add_special=True, parse_special=True)
        else:
            ids = list(body.prompt)
            if any(not 0 <= t < served.model.config.n_vocab for t in ids):
                raise APIError(400, "prompt token id outside the vocabulary", "prompt")
        params = body.params(min(16, state.limits.max_tokens))
        gen = start_generation(served, ids, params, state.limits, state.metrics)
        echo = body.prompt if (body.echo and isinstance(body.prompt, str)) else ""

        def choice(j, text, finish):
            return {"index": j, "text": echo + text, "logprobs": None, "finish_reason": finish}

        def delta(d):
            return {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return await run(gen, request, body.n, body.stream, include, choice, delta, "text_completion")

    @router.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        served = find(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                    for m in body.messages]
        try:
            text = served.template.render(messages)
        except PagedError as e:
            raise APIError(400, str(e), "messages") from None
        ids = served.tokenizer.encode(text, add_special=True, parse_special=True)
        if body.max_completion_tokens and not body.max_tokens:
            body.max_tokens = body.max_completion_tokens
        params = body.params(min(512, state.limits.max_tokens))  # a default within the limit
        gen = start_generation(served, ids, params, state.limits, state.metrics)

        def choice(j, text, finish):
            return {"index": j, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}

        started: set[int] = set()

        def delta(d):
            content = {"content": d.text} if d.text else {}
            if d.index not in started:
                started.add(d.index)
                content = {"role": "assistant", **content}
            return {"index": d.index, "delta": content, "logprobs": None, "finish_reason": d.finish_reason}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return await run(gen, request, body.n, body.stream, include, choice, delta, "chat.completion.chunk")

    return router
