"""Anthropic's Messages API: POST /v1/messages (and count_tokens), through the server's
one chat path (server/chat.py) as the OpenAI and Ollama chat routes go."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...calls.chat_call import ChatCall
from ...tools.messages import MessageError
from ..chat import ChatRun, check_call, prepare_chat_call, run_chat
from ..error_bodies import anthropic_error_body
from ..generation import APIError
from ..sse import event_stream
from ..state import server_state
from .messages import chat_call, content_blocks, stop_reason
from .schemas import CountTokensRequest, MessagesRequest
from .stream import AnswerEvents, sse


def _call(body: MessagesRequest) -> ChatCall:
    """The request as a chat call; a block the conversion cannot read is a 400."""
    try:
        return chat_call(body)
    except MessageError as e:
        raise APIError(400, str(e)) from None


async def _events(run: ChatRun, events: AnswerEvents, body: MessagesRequest):
    """The streamed answer; an error after the 200 header is an error event, as Anthropic
    sends one. The client leaving cancels this, and deltas() frees the request's pages."""
    for event in events.start():
        yield event
    finish, stop, calls = "length", None, []
    try:
        async for piece in run.pieces():
            for event in events.think(body.shown_thinking(piece.thinking)) + events.feed(piece.text):
                yield event
            if piece.finish_reason:
                finish, stop, calls = piece.finish_reason, piece.stop, body.kept_calls(piece.calls)
    except APIError as e:
        yield sse(anthropic_error_body(e.status, e.message))
        return
    for event in events.end(calls, finish, stop, run.gen.num_generated):
        yield event


router = APIRouter()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt's length in tokens, as /v1/messages would count it (nothing runs)."""
    state, call = server_state(request), _call(body)
    prepared = await prepare_chat_call(state, await check_call(state, call), call)
    return {"input_tokens": len(prepared.prompt_ids)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    """Anthropic's Messages API: the answer as a message, or as its events when stream is set."""
    run = await run_chat(server_state(request), _call(body))
    gen = run.gen
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": run.model_name,
               "usage": {"input_tokens": len(gen.prompt_ids), "output_tokens": 0}}
    if body.stream:
        return event_stream(_events(run, AnswerEvents(message), body))
    answer = (await run.answers(request))[0]
    calls = body.kept_calls(answer.calls)
    reason, sequence = stop_reason(answer.finish_reason, answer.stop, calls)
    content = content_blocks(answer.content, calls, body.shown_thinking(answer.thinking))
    return JSONResponse({**message, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": {"input_tokens": len(gen.prompt_ids), "output_tokens": gen.num_generated}})

