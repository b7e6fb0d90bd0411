"""A reasoning model's thinking comes back apart from its answer (Ollama's message.thinking,
OpenAI-style reasoning_content), streamed and not, through the unmodified ollama and openai
clients, on tiny real models whose greedy reply is a script (testing/scripted_gguf.py);
the request's switch (think, enable_thinking, reasoning_effort) renders the template without
thinking, and a tool call after the thinking comes back as a tool call."""

import json

import ollama
import openai
import pytest

from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import EngineOptions, ModelRegistry
from pyllama_paged.testing.scripted_gguf import OPEN_THINK_TEMPLATE, THINKING_TEMPLATE, write_scripted_model
from pyllama_paged.testing.serving import Running

HELLO = [{"role": "user", "content": "Hello"}]
THINKING = "The user says hello."
ANSWER = "Hello! How can I help?"
# after "<think>\n\n</think>\n\n" (thinking switched off) the script goes on from "\n\n": the answer
THINK_THEN_ANSWER = ["<think>", "\n" + THINKING + "\n", "</think>", "\n\n", "Hello!", " How can I help?"]
CLOSE_THEN_ANSWER = ["The user greets me.\n", "</think>", "\n\n", "Hi there!"]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
THINK_THEN_CALL = ["<think>", "\nThe user wants the weather in Paris.\n", "</think>", "\n\n",
                   "<tool_call>", "\n" + json.dumps(CALL) + "\n", "</tool_call>"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinkers")
    paths = [write_scripted_model(folder / "thinker.gguf", THINK_THEN_ANSWER, THINKING_TEMPLATE),
             write_scripted_model(folder / "opener.gguf", CLOSE_THEN_ANSWER, OPEN_THINK_TEMPLATE),
             write_scripted_model(folder / "caller.gguf", THINK_THEN_CALL, THINKING_TEMPLATE)]
    registry = ModelRegistry(paths, EngineOptions(n_ctx=512, n_threads=2, n_batch=128, kv_tokens=4096,
                                                  max_num_seqs=8))
    s = Running(create_app(registry, Limits(max_tokens=64)))
    yield s
    s.close()
    registry.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url)


def test_ollama_thinking_apart_from_the_answer(oll):
    whole = oll.chat(model="thinker", messages=HELLO, think=True, options={"temperature": 0})
    assert (whole.message.thinking, whole.message.content) == (THINKING, ANSWER)
    thinking = content = ""
    for chunk in oll.chat(model="thinker", messages=HELLO, think=True, stream=True, options={"temperature": 0}):
        thinking += chunk.message.thinking or ""
        content += chunk.message.content or ""
    assert (thinking, content) == (THINKING, ANSWER)
    assert "thinking" in oll.show("thinker").capabilities


def test_ollama_think_false_renders_the_template_without_thinking(oll):
    for stream in (False, True):
        chunks = oll.chat(model="thinker", messages=HELLO, think=False, stream=stream, options={"temperature": 0})
        chunks = chunks if stream else [chunks]
        assert "".join(c.message.content or "" for c in chunks) == ANSWER
        assert not any(c.message.thinking for c in chunks)


def test_openai_reasoning_content_streamed_and_not(oai):
    out = oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0)
    message = out.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THINKING, ANSWER)
    thinking = content = ""
    for chunk in oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0, stream=True):
        if chunk.choices:
            thinking += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (thinking, content) == (THINKING, ANSWER)


def test_openai_switches_thinking_off(oai):
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        out = oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0, extra_body=extra)
        message = out.choices[0].message
        assert message.content == ANSWER and not (message.model_extra or {}).get("reasoning_content"), extra


def test_a_prompt_that_opens_the_think_block(oai, oll):
    message = oai.chat.completions.create(model="opener", messages=HELLO, temperature=0).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("The user greets me.", "Hi there!")
    whole = oll.chat(model="opener", messages=HELLO, think=True, options={"temperature": 0})
    assert (whole.message.thinking, whole.message.content) == ("The user greets me.", "Hi there!")


def test_a_tool_call_after_the_thinking_is_a_tool_call(oai, oll):
    out = oai.chat.completions.create(model="caller", messages=HELLO, tools=[WEATHER_TOOL], temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather in Paris."
    call = choice.message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == (CALL["name"], CALL["arguments"])
    for stream in (False, True):
        chunks = oll.chat(model="caller", messages=HELLO, tools=[WEATHER_TOOL], think=True, stream=stream,
                          options={"temperature": 0})
        chunks = chunks if stream else [chunks]
        calls = [c for chunk in chunks for c in (chunk.message.tool_calls or [])]
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [(CALL["name"], CALL["arguments"])]


def test_a_model_that_does_not_think_still_refuses_think(tmp_path):
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    path = write_tiny_model(tmp_path / "plain.gguf", "gemma3", weight_type="q8_0")
    registry = ModelRegistry([path], EngineOptions(n_ctx=256, n_threads=1, kv_tokens=1024, max_num_seqs=2))
    s = Running(create_app(registry, Limits(max_tokens=8)))
    try:
        with pytest.raises(ollama.ResponseError, match="does not support thinking"):
            ollama.Client(host=s.url).chat(model="plain", messages=HELLO, think=True)
        assert "thinking" not in ollama.Client(host=s.url).show("plain").capabilities
    finally:
        s.close()
        registry.close()
