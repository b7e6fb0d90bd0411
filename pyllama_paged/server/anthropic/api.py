"""Anthropic's Messages API: POST /v1/messages, on the engine, limits, chat
templates and tool machinery the OpenAI and Ollama routes use."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...errors import PagedError
from ...tools.calls import parse_tool_calls
from ...tools.messages import normalize_messages
from ...tools.prompt import prepare_chat
from .messages import chat_messages, chat_tools, content_blocks, stop_reason
from .schemas import CountTokensRequest, MessagesRequest, error_body
from .stream import AnswerEvents, sse
from ..generation import APIError, Generation, check_request, off_loop, require_generative, start_generation


async def _events(gen: Generation, events: AnswerEvents, body: MessagesRequest, state):
    """The streamed answer; an error after the 200 header is an error event, as Anthropic
    sends one. The client leaving cancels this, and deltas() frees the request's pages."""
    for event in events.start():
        yield event
    finish, stop = "length", None
    try:
        async for d in gen.deltas():
            for event in events.feed(d.text):
                yield event
            if d.finish_reason:
                finish, stop = d.finish_reason, d.stop
        rest, calls = await off_loop(state.prep, events.held)
        calls = body.kept_calls(calls)
    except APIError as e:
        yield sse(error_body(e.status, e.message))
        return
    for event in events.end(rest, calls, finish, stop, gen.num_generated):
        yield event


def build_router(state) -> APIRouter:
    """The router of /v1/messages."""
    router = APIRouter()

    async def served_for(body: MessagesRequest):
        """The model body names, after the checks every route makes (limits, model, features)."""
        check_request(state.limits, stop=body.stop_sequences, messages=body.messages, tools=body.tools,
                      grammars={"output_config": body.schema()})
        served = await state.registry.resolve(body.model)
        if served is None:
            raise APIError(404, f"model '{body.model}' not found; available: {', '.join(state.registry.names())}",
                           "model")
        require_generative(served)
        body.refuse_unsupported()
        return served

    async def _prompt(served, body: MessagesRequest):
        """The prompt's token ids, its constraint and its tool names (templates, tokenizing and
        grammars take a while: off the event loop)."""
        def prepare():
            tools, tool_choice = chat_tools(body)
            turns = normalize_messages(chat_messages(body))
            text, constraint, names = prepare_chat(served.template, served.tokenizer, turns, tools, tool_choice,
                                                   body.constraint(served.tokenizer))
            return served.tokenizer.encode(text, add_special=True, parse_special=True), constraint, names

        try:
            return await off_loop(state.prep, prepare)
        except PagedError as e:
            raise APIError(400, str(e)) from None

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        """The prompt's length in tokens, as /v1/messages would count it (nothing runs)."""
        ids, _, _ = await _prompt(await served_for(body), body)
        return {"input_tokens": len(ids)}

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API: the answer as a message, or as its events when stream is set."""
        served = await served_for(body)

        ids, constraint, names = await _prompt(served, body)
        # nothing is held before this: every refusal above leaves the queue and pool as they were
        gen = start_generation(served, ids, body.params(constraint), state.limits, state.metrics)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": served.name,
                   "usage": {"input_tokens": len(gen.prompt_ids), "output_tokens": 0}}
        if body.stream:
            return StreamingResponse(_events(gen, AnswerEvents(message, names), body, state),
                                     media_type="text/event-stream")
        deltas = await gen.collect(request)
        text = "".join(d.text for d in deltas)
        end = next((d for d in reversed(deltas) if d.finish_reason), None)
        calls = []
        if names:
            text, calls = await off_loop(state.prep, parse_tool_calls, text, names)
            calls = body.kept_calls(calls)
        reason, sequence = stop_reason(end.finish_reason if end else "length", end.stop if end else None, calls)
        return JSONResponse({**message, "content": content_blocks(text, calls), "stop_reason": reason,
                             "stop_sequence": sequence,
                             "usage": {"input_tokens": len(gen.prompt_ids), "output_tokens": gen.num_generated}})

    return router
