"""OpenAI's Responses API: POST /v1/responses (streamed or not, function tools,
structured output through text.format, previous_response_id), GET and DELETE
/v1/responses/{id}. The input becomes chat messages, which go the server's one chat
path (server/chat.py) as /v1/chat/completions' do; past responses live in a bounded
in-memory store (responses_store)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..chat import run_chat
from ..generation import APIError, off_loop, refuse_over
from ..sse import event_stream
from ..state import server_state
from .responses_items import ResponseObject, answer_message, input_messages, output_items, usage, with_instructions
from .responses_schemas import ResponsesRequest
from .responses_store import ResponseStore, StoredResponse
from .responses_stream import ResponseEvents


router = APIRouter()


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"No response with id '{response_id}' is stored here (this server keeps the "
                       f"last {store.capacity} responses, in memory)", param, code="response_not_found")
    return entry


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request):
    state = server_state(request)
    store = state.responses
    refuse_over(state.limits, "max_tokens", body.max_output_tokens or 0, "max_output_tokens",
                "max_output_tokens")
    # instructions are not carried over from the previous response (OpenAI's rule): the
    # stored conversation leaves them out
    history = _stored(store, body.previous_response_id, "previous_response_id").conversation \
        if body.previous_response_id else []
    conversation = history + input_messages(body.input)
    if not conversation:
        raise APIError(400, "input is empty", "input")
    run = await run_chat(state, body.chat_call(with_instructions(body.instructions, conversation)))
    response = ResponseObject(run.served.name, body.echo())

    def keep(result: dict, content: str, calls) -> None:
        if body.store is not False:
            store.put(response.id, StoredResponse(result, conversation + [answer_message(content, calls)]))

    if not body.stream:
        answer = (await run.answers(request))[0]
        status = _status(run)
        result = response.body(status, output_items(answer.content, answer.calls, status, answer.thinking),
                               await _spent(state, run, answer.thinking))
        keep(result, answer.content, answer.calls)
        return JSONResponse(result)
    return event_stream(_events(state, run, response, keep))


def _status(run) -> str:
    return "incomplete" if run.gen.finish_reasons.get(0, "length") == "length" else "completed"


async def _spent(state, run, thinking: str) -> dict:
    """The usage: the thinking's tokens are its text as the model's tokenizer cuts it, and the block's two tags."""
    ids = await off_loop(state.prep, run.served.tokenizer.encode, thinking, False) if thinking else []
    return usage(len(run.gen.prompt_ids), run.gen.num_generated, len(ids) + 2 if ids else 0)


async def _events(state, run, response: ResponseObject, keep):
    """The streamed response's events; keep(result, content, calls) stores it before the last one."""
    writer, content, calls, thinking = ResponseEvents(response), [], [], []
    for event in writer.start():
        yield event
    try:
        async for piece in run.pieces():
            calls += piece.calls
            if piece.thinking:
                thinking.append(piece.thinking)
                for event in writer.thinking(piece.thinking):
                    yield event
            if piece.text:
                content.append(piece.text)
                for event in writer.text(piece.text):
                    yield event
    except APIError as e:   # after the 200 header: the response fails, as OpenAI's would
        yield writer.fail(e.code or e.type, e.message)
        return
    finished, result = writer.finish(calls, _status(run), await _spent(state, run, "".join(thinking)))
    keep(result, "".join(content), calls)   # before the last event: a client may retrieve at once
    for event in finished:
        yield event


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request):
    return JSONResponse(_stored(server_state(request).responses, response_id, "response_id").body)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request):
    store = server_state(request).responses
    _stored(store, response_id, "response_id")
    store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
