"""What a new user's first hour met on the server (issue 40): Ollama's /api/chat with tools
and a plain-text answer through the unmodified `ollama` client, streamed and not; and
llama-server's OpenAI paths without /v1 (dspy's Ollama provider posts to /chat/completions),
against a real server on the default model."""

import httpx
import ollama
import openai
import pytest

from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.testing.serving import default_model_server, wait_pool_empty

M = DEFAULT_MODEL_NAME

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with default_model_server(Limits(max_tokens=64), n_ctx=512, n_threads=2, n_batch=128, block_size=32,
                              kv_budget_tokens=4096, max_num_seqs=8) as s:
        yield s


def test_ollama_chat_with_tools_keeps_a_plain_answer(server):
    client = ollama.Client(host=server.url)
    messages = [{"role": "user", "content": "Write a sentence about the sea."}]
    options = {"temperature": 0, "num_predict": 24, "seed": 7}
    # the tools are offered but the (base) model answers in prose: that prose is the content
    whole = client.chat(model=M, messages=messages, tools=[WEATHER_TOOL], stream=False, options=options)
    assert not whole.message.tool_calls
    assert whole.message.content.strip(), "a plain-text answer came back empty"
    pieces = list(client.chat(model=M, messages=messages, tools=[WEATHER_TOOL], stream=True, options=options))
    streamed = "".join(p.message.content or "" for p in pieces)
    assert pieces[-1].done and not any(p.message.tool_calls for p in pieces)
    assert streamed == whole.message.content   # one request each, greedy: the same answer
    # and what OpenAI's route answers to the same chat
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(model=M, messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                    max_tokens=24, seed=7)
    assert r.choices[0].message.content == whole.message.content
    assert wait_pool_empty(server.url)


def test_ollama_chat_with_tools_still_returns_calls(server):
    # a format shaped like the call makes the base model write one: it must come back as a call
    call_format = {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"const": "get_weather"}, "arguments": {
            "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}}}}}
    client = ollama.Client(host=server.url)
    for stream in (False, True):
        r = client.chat(model=M, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                        format=call_format, stream=stream, options={"temperature": 0, "num_predict": 40})
        parts = list(r) if stream else [r]
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
        assert [c.function.name for c in calls] == ["get_weather"], stream
        assert isinstance(calls[0].function.arguments["city"], str)
        assert not "".join(p.message.content or "" for p in parts).strip()


def test_openai_paths_without_v1(server):
    # llama-server serves its OpenAI routes with and without /v1; dspy and others post to the bare path
    bare = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    chat = bare.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason in ("stop", "length")
    text = bare.completions.create(model=M, prompt="Once upon a time", max_tokens=4)
    assert text.object == "text_completion" and text.choices[0].text
    chunks = list(bare.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    vectors = bare.embeddings.create(model=M, input=["a cat", "a dog"])
    assert [len(d.embedding) for d in vectors.data] == [640, 640]
    assert M in [m.id for m in bare.models.list()]
    assert bare.models.retrieve(M).id == M
    # the /v1 routes are unchanged, and errors on the bare paths keep OpenAI's shape
    versioned = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert versioned.embeddings.create(model=M, input="a cat").data[0].embedding == \
        bare.embeddings.create(model=M, input="a cat").data[0].embedding
    with pytest.raises(openai.NotFoundError):
        bare.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    r = httpx.post(f"{server.url}/chat/completions", timeout=30,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # the bare paths are aliases: the documented schema lists the /v1 ones only
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths
    assert wait_pool_empty(server.url)
