"""Anthropic's Messages API (POST /v1/messages) driven by the unmodified `anthropic` SDK
against a real server on the default model: plain, system and multi-turn messages,
stop sequences, streaming, a tool round trip, structured output, errors in Anthropic's
shape, the API key, and a client leaving mid-stream.

The SDK no longer takes temperature as a keyword (newer Claude models fix it), so greedy
decoding, which makes answers comparable, is asked for through extra_body as any
Anthropic-compatible server's extra field would be."""

from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.testing.serving import Running, pool_used, wait_pool_empty, wait_until

M = DEFAULT_MODEL_NAME
KEY = "sekrit-key"
GREEDY = {"temperature": 0}
HI = [{"role": "user", "content": "Say hi"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["C", "F"]}},
                            "required": ["city", "unit"]}}


SERVE = dict(n_ctx=1024, n_threads=2, n_batch=256, block_size=32, kv_budget_tokens=16384, max_num_seqs=16)
LIMITS = Limits(max_tokens=300)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def ask(client, max_tokens=8, messages=HI, **kw):
    return client.messages.create(model=M, max_tokens=max_tokens, messages=messages, extra_body=GREEDY, **kw)


def test_create_plain_matches_the_chat_route(client, server):
    r = ask(client)
    assert r.type == "message" and r.role == "assistant" and r.model == M and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    # the same template, engine and sampling as the OpenAI route: the same greedy answer
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").chat.completions.create(
        model=M, max_tokens=8, temperature=0, messages=HI)
    assert chat.choices[0].message.content == r.content[0].text
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_system_as_string_or_blocks_and_multi_turn(client):
    plain = ask(client)
    as_string = ask(client, system="You are terse.")
    as_blocks = ask(client, system=[{"type": "text", "text": "You are terse."}])
    assert as_string.content[0].text == as_blocks.content[0].text
    assert as_string.usage.input_tokens == as_blocks.usage.input_tokens > plain.usage.input_tokens
    turns = [{"role": "user", "content": "Say hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
             {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "please."}]}]
    again = ask(client, messages=turns, metadata={"user_id": "someone"})
    assert again.content[0].text and again.usage.input_tokens > plain.usage.input_tokens


def test_stop_sequences_name_the_one_that_stopped(client):
    full = ask(client, max_tokens=12).content[0].text
    word = full.split()[1]
    r = ask(client, max_tokens=12, stop_sequences=["never appears", word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert full.startswith(r.content[0].text) and word not in r.content[0].text


def test_stream_events_accumulate_to_the_final_message(client):
    whole = ask(client, max_tokens=10)
    with client.messages.stream(model=M, max_tokens=10, messages=HI, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens == 10
    events = [e.type for e in client.messages.create(model=M, max_tokens=4, messages=HI, stream=True)]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_tool_round_trip(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ask(client, max_tokens=100, messages=question, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use"
    call = r.content[-1]
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input["city"], str) and call.input["unit"] in ("C", "F")
    # the SDK's own blocks go back as the assistant turn, the result as a tool_result block
    history = question + [{"role": "assistant", "content": r.content},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": [{"type": "text", "text": "18 C"}]}]}]
    final = ask(client, max_tokens=6, messages=history, tools=[WEATHER])
    assert [b.type for b in final.content] == ["text"] and final.stop_reason in ("end_turn", "max_tokens")
    # the same tools, and the call and its result on top of the question
    assert final.usage.input_tokens > r.usage.input_tokens


def test_streamed_tool_use_has_its_input_as_json_deltas(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=M, max_tokens=100, messages=question, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    once = ask(client, max_tokens=100, messages=question, tools=[WEATHER], tool_choice={"type": "any"})
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in once.content]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: Literal[0, 4]


def test_structured_output_holds_the_answer_to_the_schema(client):
    r = client.messages.parse(model=M, max_tokens=40, messages=[{"role": "user", "content": "Name a pet."}],
                              output_format=Pet, extra_body=GREEDY)
    assert isinstance(r.parsed_output, Pet)


def test_errors_have_anthropics_types(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:   # omitted (the timeout keeps the SDK from needing it)
        client.messages.create(model=M, max_tokens=anthropic.NOT_GIVEN, messages=HI, timeout=60)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="role"):
        client.messages.create(model=M, max_tokens=4, messages=[{"role": "system", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error" and M in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    for bad, needle in [(dict(messages=[{"role": "user", "content": [image]}]), "images are not supported by this model"),
                        (dict(messages=HI, tools=[WEATHER], tool_choice={"type": "tool", "name": "other"}), "other"),
                        (dict(messages=HI, max_tokens=301), "max_tokens"),
                        (dict(messages=HI, thinking={"type": "enabled", "budget_tokens": 2048}), "think")]:
        with pytest.raises(anthropic.BadRequestError, match=needle):
            client.messages.create(**{"model": M, "max_tokens": 4, **bad})
    assert wait_pool_empty(server.url)   # nothing refused kept a page


def test_api_key_by_anthropics_header(registry):
    s = Running(create_app(registry, Limits(), api_key=KEY))
    try:
        good = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0)
        assert good.messages.create(model=M, max_tokens=2, messages=HI).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model=M, max_tokens=2, messages=HI)
        assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        s.close()


def test_client_leaving_mid_stream_returns_its_pages(client, server, registry):
    # the answer would run to max_tokens (greedy, it does not end by itself): the pages
    # must come back because the client left
    def stats():
        return httpx.get(server.url + "/api/pool").json()["stats"]

    assert wait_pool_empty(server.url)
    before = stats()
    essay = [{"role": "user", "content": "Write a long essay about rivers."}]
    with client.messages.stream(model=M, max_tokens=256, messages=essay, extra_body=GREEDY) as stream:
        for n, _ in enumerate(stream.text_stream):
            if n == 2:
                assert pool_used(server.url) > before["blocks_used"]
                break
    loop = registry.get(M).loop
    wait_until(lambda: loop.call(lambda llm: llm.has_work()) is False, timeout=120, what="the abort")
    after = stats()
    assert after["blocks_used"] == before["blocks_used"]
    # stopped short of its 256 tokens (how far short depends on how busy the machine is: the
    # client's hang-up reaches the engine a loop turn or more after it happens)
    assert after["generated_tokens"] - before["generated_tokens"] < 256


def test_count_tokens_counts_what_create_reads(client):
    counted = client.messages.count_tokens(model=M, messages=HI, system="You are terse.")
    assert counted.input_tokens == ask(client, system="You are terse.").usage.input_tokens
    with_tool = client.messages.count_tokens(model=M, messages=HI, tools=[WEATHER])
    assert with_tool.input_tokens > client.messages.count_tokens(model=M, messages=HI).input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=HI)
