"""Embedding routes: Ollama's /api/embed (and the legacy /api/embeddings) and
OpenAI's /v1/embeddings. Every input of a request is its own engine request,
submitted together, so the model's scheduler (or the encoder's batcher) runs
them beside other users' work; a failure aborts the rest."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ...calls.embeddings import as_base64, finish_vector, max_input_tokens, openai_list, tokenize_inputs
from ...engine import EmbedParams, TOKEN_STATES, default_pooling
from ...errors import PagedError
from ..generation import APIError, admit, off_loop, refuse_over
from ..keep_alive import keep_alive_seconds
from ..lookup import find_model
from ..state import server_state
from ..openai_token_arrays import decode_openai_tokens
from ..registry import ServedModel


class EmbedOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    num_ctx: int | None = Field(None, gt=0)     # inputs cut (or refused) at this many tokens
    pooling: str | None = None                  # ours: mean, cls or last (default: the model's)


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: str | list[str] | None = None       # None: Ollama's "load the model" (no embeddings)
    truncate: bool | None = True
    dimensions: int | None = Field(None, gt=0)
    options: EmbedOptions | None = None
    keep_alive: str | int | float | None = None


class OllamaLegacyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    prompt: str = ""
    options: EmbedOptions | None = None
    keep_alive: str | int | float | None = None


class OpenAIEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str | None = "float"
    dimensions: int | None = Field(None, gt=0)
    user: str | None = None
    pooling: str | None = None                  # ours, as in EmbedOptions
    truncate: bool | None = False               # ours: OpenAI refuses over-long inputs


async def embed_ids(served: ServedModel, inputs: list[list[int]], pooling: str | None) -> list[np.ndarray]:
    """Pooled vectors of token lists, every input a request on the model's engine loop."""
    if pooling == TOKEN_STATES:   # per-token states are Llama.embed's; an answer holds one vector per input
        raise APIError(400, f"pooling '{pooling}' is not supported (choose one of mean, cls, last)", "pooling")
    try:
        params = EmbedParams(pooling or default_pooling(served.config))   # checks itself
    except PagedError as e:
        raise APIError(400, str(e), "pooling") from None
    return await pooled_states(served, inputs, [params] * len(inputs))


async def pooled_states(served: ServedModel, inputs: list[list[int]], params: list[EmbedParams],
                        what: str = "input") -> list[np.ndarray]:
    """Each input's pooled state under its own params, all submitted to the engine loop at
    once (so they share steps); a failure aborts the rest and is a 400 naming `what` i."""
    streams = [served.loop.submit(ids, p) for ids, p in zip(inputs, params)]

    async def one(i, stream) -> np.ndarray:
        async for out in stream:
            if out.error:
                raise APIError(400, f"{what} {i}: {out.error}", what)
            if out.embedding is not None:
                return out.embedding
        raise APIError(500, f"{what} {i}: the engine ended the request without a result", None, "server_error")

    try:
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(streams)))
    except PagedError as e:   # the engine step failed
        raise APIError(500, f"the engine failed: {e}", None, "server_error") from None
    finally:
        for s in streams:   # finished ones: a no-op; the rest free their pages now
            s.abort()


@asynccontextmanager
async def holding(state, served: ServedModel):
    """One of the model's queue places and its engine (loaded if keep_alive had dropped it), as
    a generation holds them; yields the seconds the load took."""
    admit(served, state.limits, state.metrics)
    try:
        took = await served.acquire()
        try:
            yield took
        finally:
            served.release()
    finally:
        state.metrics.leave(served.name)


def check_inputs(inputs: list, limits) -> None:
    """The embedding limits (number of inputs, their total size), before any work: a 400
    naming the option. A string counts its characters, a token array its tokens."""
    if not inputs:
        raise APIError(400, "input is empty: give a string or a non-empty list of strings", "input")
    refuse_over(limits, "max_embedding_inputs", len(inputs), "the number of inputs", "input")
    refuse_over(limits, "max_embedding_chars", sum(len(i) for i in inputs), "the total size of the inputs",
                "input")


def _tokenized(served: ServedModel, texts: list[str], truncate: bool, num_ctx: int | None) -> list[list[int]]:
    limit = max_input_tokens(served.loop.llm)
    if num_ctx:
        limit = min(limit, num_ctx)
    try:
        return tokenize_inputs(served.tokenizer, texts, limit, truncate)
    except PagedError as e:
        raise APIError(400, str(e), "input") from None


def _finished(vectors, normalize: bool, dimensions: int | None) -> list[np.ndarray]:
    try:
        return [finish_vector(v, normalize, dimensions) for v in vectors]
    except PagedError as e:
        raise APIError(400, str(e), "dimensions") from None


router = APIRouter()


async def _touch(served: ServedModel, keep_alive) -> None:
    """keep_alive as on the generation routes: the last request's wins; 0 drops the
    engine now unless another request holds it."""
    served.keep_alive = keep_alive
    served.last_used = time.time()
    if served.keep_alive == 0:
        await served.unload_if_idle()


async def _embed_texts(state, served: ServedModel, texts, truncate, num_ctx, pooling):
    """(token lists, pooled vectors, load seconds), holding the engine (loaded if it was dropped)
    and one of the model's queue places, as a generation does."""
    async with holding(state, served) as took:
        # off the event loop: a big batch takes a while
        ids = await off_loop(state.prep, _tokenized, served, texts, truncate, num_ctx)
        return ids, await embed_ids(served, ids, pooling), took


@router.post("/api/embed")
async def embed(body: OllamaEmbedRequest, request: Request):
    state = server_state(request)
    started = time.perf_counter()
    served = await find_model(state.registry, body.model)
    keep_alive = keep_alive_seconds(body.keep_alive)
    options = body.options or EmbedOptions()
    if body.input is None:
        await _touch(served, keep_alive)
        return {"model": body.model, "embeddings": [], "total_duration": 0, "load_duration": 0,
                "prompt_eval_count": 0}
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_inputs(texts, state.limits)
    ids, pooled, took = await _embed_texts(state, served, texts, body.truncate is not False, options.num_ctx,
                                          options.pooling)
    vectors = _finished(pooled, True, body.dimensions)
    await _touch(served, keep_alive)
    count = sum(len(i) for i in ids)
    state.metrics.add_tokens(count, 0)
    return {"model": body.model, "embeddings": [v.tolist() for v in vectors],
            "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": int(took * 1e9),
            "prompt_eval_count": count}


@router.post("/api/embeddings")
async def embeddings(body: OllamaLegacyRequest, request: Request):
    state = server_state(request)
    # the legacy route: one prompt, the vector as pooled (not normalized), as Ollama's
    served = await find_model(state.registry, body.model)
    keep_alive = keep_alive_seconds(body.keep_alive)
    options = body.options or EmbedOptions()
    if not body.prompt:   # Ollama answers an empty prompt with an empty vector (a load)
        await _touch(served, keep_alive)
        return {"embedding": []}
    check_inputs([body.prompt], state.limits)
    ids, vectors, _ = await _embed_texts(state, served, [body.prompt], True, options.num_ctx, options.pooling)
    await _touch(served, keep_alive)
    state.metrics.add_tokens(len(ids[0]), 0)
    return {"embedding": vectors[0].tolist()}


@router.post("/v1/embeddings")
async def openai_embeddings(body: OpenAIEmbedRequest, request: Request):
    state = server_state(request)
    served = await find_model(state.registry, body.model)
    if body.encoding_format not in (None, "float", "base64"):
        raise APIError(400, f"encoding_format {body.encoding_format!r} is not one of 'float', 'base64'",
                       "encoding_format")
    raw: Any = body.input
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    check_inputs(raw, state.limits)
    texts = await off_loop(state.prep, _texts_of, raw)
    ids, pooled, _ = await _embed_texts(state, served, texts, bool(body.truncate), None, body.pooling)
    vectors = _finished(pooled, True, body.dimensions)
    served.last_used = time.time()
    count = sum(len(i) for i in ids)
    state.metrics.add_tokens(count, 0)
    encode = as_base64 if body.encoding_format == "base64" else (lambda v: v.tolist())
    return openai_list([encode(v) for v in vectors], served.name, count)


def _texts_of(inputs: list) -> list[str]:
    """OpenAI inputs as texts: strings as given, token arrays decoded (see openai_token_arrays)."""
    texts = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            texts.append(item)
            continue
        try:
            texts.append(decode_openai_tokens(item))
        except PagedError as e:
            raise APIError(400, f"input {i}: {e}", "input") from None
    return texts
