"""The OpenAI Responses API (POST/GET/DELETE /v1/responses) through the unmodified
`openai` client and the `openai-agents` SDK, against a real server on the default
model. Greedy decoding (temperature 0) makes every answer repeatable, so a streamed
answer, a continued conversation and the same conversation sent whole can be
compared exactly; forced tool_choice and text.format make the base model call
tools and answer in JSON."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from pyllama_paged.server.generation import Limits
from pyllama_paged.server.openai.responses_store import ResponseStore, StoredResponse
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.testing.serving import pool_used, wait_pool_empty, wait_until

M = DEFAULT_MODEL_NAME
GREEDY = {"model": M, "temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


SERVE = dict(n_ctx=1024, n_threads=2, n_batch=256, block_size=32, kv_budget_tokens=16384, max_num_seqs=32)
LIMITS = Limits(max_tokens=300)   # the server and its oai client: tests/server/conftest.py


def test_plain_and_with_instructions(oai):
    r = oai.responses.create(input="Say hello", max_output_tokens=8, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == M
    # this prompt runs on past 8 tokens under greedy decoding: cut short, and said so
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    told = oai.responses.create(input="Say hello", instructions="Answer in French.", max_output_tokens=8, **GREEDY)
    assert told.instructions == "Answer in French."
    assert told.usage.input_tokens > r.usage.input_tokens   # the instructions are in the prompt
    # the same as a system (developer) message given in the input
    as_message = oai.responses.create(input=[{"role": "developer", "content": "Answer in French."},
                                             {"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}],
                                      max_output_tokens=8, **GREEDY)
    assert as_message.usage.input_tokens == told.usage.input_tokens and as_message.output_text == told.output_text


def test_streamed_events_build_the_same_answer(oai):
    whole = oai.responses.create(input="Say hello", max_output_tokens=8, **GREEDY)
    events = list(oai.responses.create(input="Say hello", max_output_tokens=8, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8 and final.status == "incomplete"
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    # the SDK's own accumulator reads the events into the final response
    with oai.responses.stream(input="Describe a person.", text={"format": {
            "type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}, **GREEDY) as stream:
        done = stream.get_final_response()
    jsonschema.validate(json.loads(done.output_text), PERSON)


def test_function_tool_round_trip(oai):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    r = oai.responses.create(input=[question], tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                             **GREEDY)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert json.loads(call.arguments)["unit"] in ("C", "F")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    # the tool's result sent back with the whole conversation (what the agents SDK does) ...
    whole = oai.responses.create(input=[question, call.model_dump(exclude_none=True), result], tools=[WEATHER],
                                 max_output_tokens=12, **GREEDY)
    # ... or after previous_response_id: the same prompt, so the same greedy answer
    chained = oai.responses.create(input=[result], previous_response_id=r.id, tools=[WEATHER], max_output_tokens=12,
                                   **GREEDY)
    assert chained.usage.input_tokens == whole.usage.input_tokens > r.usage.input_tokens
    assert chained.output_text == whole.output_text and chained.previous_response_id == r.id
    # streamed: one function_call item, its arguments in a delta and a done event
    events = list(oai.responses.create(input=[question], tools=[WEATHER], tool_choice="required", stream=True,
                                       **GREEDY))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = events[4]
    assert done.name == "get_weather" and done.arguments == events[3].delta == events[-1].response.output[0].arguments
    assert events[2].item.status == "in_progress" and events[5].item.status == "completed"


def test_json_schema_and_json_object_output(oai):
    for seed in range(3):
        r = oai.responses.create(model=M, input="Describe a person.", temperature=1.0, extra_body={"seed": seed},
                                 text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), PERSON)
    r = oai.responses.create(input="Describe a person.", text={"format": {"type": "json_object"}},
                             max_output_tokens=40, **GREEDY)
    assert r.output_text.startswith("{") and r.text.format.type == "json_object"


def test_previous_response_id_continues_the_conversation(oai):
    first = oai.responses.create(input="My name is Ada.", instructions="Be brief.", max_output_tokens=6, **GREEDY)
    second = oai.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=6,
                                  **GREEDY)
    # the same conversation sent whole: the instructions are not carried over (OpenAI's rule)
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
               {"role": "user", "content": "What is my name?"}]
    whole = oai.responses.create(input=history, max_output_tokens=6, **GREEDY)
    assert second.usage.input_tokens == whole.usage.input_tokens and second.output_text == whole.output_text
    assert second.instructions is None
    # a response kept out of the store cannot be continued nor retrieved
    unkept = oai.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(input="Hi", previous_response_id=unkept.id, **GREEDY)


def test_retrieve_and_delete(oai):
    r = oai.responses.create(input="Say hello", max_output_tokens=4, metadata={"run": "7"}, **GREEDY)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    assert got.metadata == {"run": "7"}
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(r.id)
    assert e.value.body["code"] == "response_not_found"


def test_store_keeps_only_the_last_responses():
    store = ResponseStore(capacity=3)
    for i in range(5):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, []))
    assert len(store) == 3 and store.get("resp_1") is None and store.get("resp_4").body["id"] == "resp_4"
    assert store.delete("resp_2") and not store.delete("resp_2")


@pytest.mark.parametrize("body, status, param, needle", [
    ({"model": "nope", "input": "x"}, 404, "model", "does not exist"),
    ({"model": M, "input": [{"type": "weird"}]}, 400, "input", "input[0].type 'weird' is not supported"),
    ({"model": M, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input", "images are not supported"),
    ({"model": M, "input": [{"role": "wizard", "content": "x"}]}, 400, "input", "input[0].role"),
    ({"model": M, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400,
     "input", "not valid JSON"),
    ({"model": M, "input": 5}, 400, "input", "input"),
    ({"model": M, "input": []}, 400, "input", "empty"),
    ({"model": M, "input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id", "resp_unknown"),
    ({"model": M, "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "only function tools"),
    ({"model": M, "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400,
     None, "nope"),
    ({"model": M, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format", "yaml"),
    ({"model": M, "input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens", "--max-tokens"),
    ({"model": M, "input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning", "reason"),
    ({"model": M, "input": "x", "background": True}, 400, "background", "background"),
    # a stored response keeps these: OpenAI's bounds, or 256 stored responses pin hundreds of MiB
    ({"model": M, "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "16 pairs"),
    ({"model": M, "input": "x", "metadata": {"k" * 65: "v"}}, 400, "metadata", "64 characters"),
    ({"model": M, "input": "x", "metadata": {"k": "v" * (1 << 19)}}, 400, "metadata", "512 characters"),
    ({"model": M, "input": "x", "user": "u" * (1 << 19)}, 400, "user", "256 characters"),
])
def test_bad_requests_are_clear_4xx_in_openai_shape(server, body, status, param, needle):
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"].startswith(param)   # a field of a union is named with its branch
    # nothing was held: no queue place, no pages
    assert server.app.state.pp.metrics.inflight[M] == 0 and pool_used(server.url) == 0


def test_errors_through_the_client(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="llama9:900b", input="hi")
    assert e.value.body["code"] == "model_not_found" and M in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=M, input=[{"type": "item_reference", "id": "msg_1"}])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=M, input="hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_nope")


def test_client_hanging_up_mid_stream_returns_its_pages(server):
    # the request stops well short of max_output_tokens because the client left (ignore_eos:
    # it cannot end earlier by itself)
    def stats():
        return httpx.get(server.url + "/api/pool").json()["stats"]

    body = {"model": M, "input": "Write a long essay about rivers.", "max_output_tokens": 256, "ignore_eos": True,
            "temperature": 0, "stream": True}
    loop = server.app.state.pp.registry.get(M).loop
    # The server generates whether or not the client reads: a client held up (a loaded CI
    # machine) can find all 256 tokens done by its third delta, and then there is nothing left
    # to abort. Such a try proves nothing either way; the next one hangs up in time.
    for _ in range(3):
        assert wait_pool_empty(server.url)
        before = stats()
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", server.url + "/v1/responses", json=body) as r:
                deltas = (line for line in r.iter_lines() if line.startswith("data: ") and "output_text.delta" in line)
                for _ in range(3):
                    next(deltas)
                running = pool_used(server.url) > before["blocks_used"]
        wait_until(lambda: loop.call(lambda llm: llm.has_work()) is False, timeout=120, what="the abort")
        if running:
            break
    assert running, "the request never held pages while it streamed"
    after = stats()
    assert after["blocks_used"] == before["blocks_used"]
    # stopped short of its 256 tokens (how far short depends on how busy the machine is: the
    # client's hang-up reaches the engine a loop turn or more after it happens)
    assert after["generated_tokens"] - before["generated_tokens"] < 256
    assert server.app.state.pp.metrics.inflight[M] == 0


def test_openapi_documents_the_stream(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert "text/event-stream" in paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert "4XX" in paths["/v1/responses/{response_id}"]["get"]["responses"]


def test_openai_agents_runs_a_one_tool_agent_to_completion(server):
    agents = pytest.importorskip("agents")   # the test extra installs it; see pyproject.toml
    from typing import Literal

    agents.set_tracing_disabled(True)
    asked = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        asked.append(city)
        return f"18 C in {city}"

    async def run():
        # a client per event loop: its connection pool belongs to the loop that made it
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=M, openai_client=client),
            # the call is forced on the first turn (the SDK resets tool_choice after it), and
            # greedy decoding makes the second turn's answer the same every run
            model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=16))
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert asked and asked[0] in ("Paris", "Rome")
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert isinstance(result.final_output, str) and result.final_output
    assert wait_pool_empty(server.url)
