"""OpenAI's Responses API: POST /v1/responses (streamed or not, function tools,
structured output through text.format, previous_response_id), GET and DELETE
/v1/responses/{id}. The input becomes chat messages and then a chat prompt exactly
as /v1/chat/completions builds one, and runs on the same engine under the same
limits; past responses live in a bounded in-memory store (openai_responses_store)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...errors import PagedError
from ...tools.calls import ToolCallStream, parse_tool_calls
from ...tools.messages import MessageError, normalize_messages
from ...tools.prompt import prepare_chat
from ..generation import APIError, check_request, off_loop, refuse_over, require_generative, start_generation
from .api import find_model
from .responses_items import (ResponseObject, answer_message, input_messages, output_items, usage,
                                     with_instructions)
from .responses_schemas import ResponsesRequest
from .responses_store import ResponseStore, StoredResponse
from .responses_stream import ResponseEvents


def build_router(state) -> APIRouter:
    """The Responses routes, with a store of their own (one per app)."""
    router = APIRouter()
    store = ResponseStore()

    def stored(response_id: str, param: str) -> StoredResponse:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"No response with id '{response_id}' is stored here (this server keeps the "
                           f"last {store.capacity} responses, in memory)", param, code="response_not_found")
        return entry

    async def prepare(body: ResponsesRequest, served, conversation: list[dict]):
        """(prompt ids, constraint, names of the tools whose calls to parse), off the event
        loop: rendering, tokenizing and a first grammar take long."""
        tok = served.tokenizer
        tool_choice = body.chat_tool_choice()

        def work():
            messages = normalize_messages(with_instructions(body.instructions, conversation))
            text, constraint, names = prepare_chat(served.template, tok, messages, body.chat_tools(), tool_choice,
                                                   body.constraint(tok))
            return tok.encode(text, add_special=True, parse_special=True), constraint, names

        try:
            return await off_loop(state.prep, work)
        except PagedError as e:
            raise APIError(400, str(e), "input" if isinstance(e, MessageError) else None) from None

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        check_request(state.limits, messages=body.input if isinstance(body.input, list) else None,
                      tools=body.tools, grammars={"text.format": body.format_spec()})
        refuse_over(state.limits, "max_tokens", body.max_output_tokens or 0, "max_output_tokens",
                    "max_output_tokens")
        served = await find_model(state, body.model)
        require_generative(served)
        body.refuse_unsupported()
        # instructions are not carried over from the previous response (OpenAI's rule): the
        # stored conversation leaves them out
        history = stored(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id else []
        conversation = history + input_messages(body.input)
        if not conversation:
            raise APIError(400, "input is empty", "input")
        ids, constraint, names = await prepare(body, served, conversation)
        gen = start_generation(served, ids, body.params(state.limits.max_tokens, constraint), state.limits,
                               state.metrics)
        response = ResponseObject(served.name, body.echo())

        def status() -> str:
            return "incomplete" if gen.finish_reasons.get(0, "length") == "length" else "completed"

        def keep(result: dict, content: str, calls) -> None:
            if body.store is not False:
                store.put(response.id, StoredResponse(result, conversation + [answer_message(content, calls)]))

        if not body.stream:
            text = "".join(d.text for d in await gen.collect(request))
            content, calls = await off_loop(state.prep, parse_tool_calls, text, names) if names else (text, [])
            result = response.body(status(), output_items(content, calls, status()),
                                   usage(len(gen.prompt_ids), gen.num_generated))
            keep(result, content, calls)
            return JSONResponse(result)

        async def events():
            writer, calls_stream, content = ResponseEvents(response), ToolCallStream(names), []
            for event in writer.start():
                yield event
            try:
                async for d in gen.deltas():
                    # text that may be a tool call is held back until the answer ends
                    piece = calls_stream.feed(d.text) if names else d.text
                    if piece:
                        content.append(piece)
                        for event in writer.text(piece):
                            yield event
            except APIError as e:   # after the 200 header: the response fails, as OpenAI's would
                yield writer.fail(e.code or e.type, e.message)
                return
            rest, calls = await off_loop(state.prep, calls_stream.finish) if names else ("", [])
            if rest:
                content.append(rest)
                for event in writer.text(rest):
                    yield event
            finished, result = writer.finish(calls, status(), usage(len(gen.prompt_ids), gen.num_generated))
            keep(result, "".join(content), calls)   # before the last event: a client may retrieve at once
            for event in finished:
                yield event

        return StreamingResponse(events(), media_type="text/event-stream")

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return JSONResponse(stored(response_id, "response_id").body)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        stored(response_id, "response_id")
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
