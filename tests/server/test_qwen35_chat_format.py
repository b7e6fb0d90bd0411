"""Qwen3.5/3.6's chat format on the APIs: its generation prompt opens the think block (the model
only closes it) and it calls tools in XML, <function=NAME> with a <parameter=KEY> block per
argument inside <tool_call>. Through the unmodified openai and ollama clients, streamed and
not, the thinking comes back apart and the call as a call; a round trip renders the call and
its result back into the prompt. On a tiny real model whose greedy reply is a script, under a
template in Qwen3.5's shape (testing/scripted_gguf.py's QWEN35_TEMPLATE)."""

import json

import pytest

from pyllama_paged.server.generation import Limits
from pyllama_paged.testing.scripted_gguf import QWEN35_TEMPLATE, scripted_tokenizer, write_scripted_model
from pyllama_paged.testing.serving import model_server, wait_pool_empty
from pyllama_paged.tokenizer.chat_template import ChatTemplate
from pyllama_paged.tools.prompt import render_chat, tool_family

THINKING = "The user wants the weather in Paris."
XML_CALL = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
THINK_THEN_CALL = [THINKING + "\n", "</think>", "\n\n", "<tool_call>", XML_CALL, "</tool_call>"]
ARGS = {"city": "Paris", "days": 3}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_scripted_model(tmp_path_factory.mktemp("qwen35fmt") / "qwen35-format.gguf", THINK_THEN_CALL,
                                QWEN35_TEMPLATE)
    with model_server([path], Limits(max_tokens=32), n_ctx=512, n_threads=2, n_batch=128,
                      kv_tokens=2048, max_num_seqs=4) as s:
        yield s


def _call(c):
    return c.function.name, json.loads(c.function.arguments)


def test_openai_thinking_apart_and_the_xml_call_as_a_call(server, oai):
    out = oai.chat.completions.create(model="qwen35-format", messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content.strip() == THINKING
    assert [_call(c) for c in choice.message.tool_calls] == [("get_weather", ARGS)]
    chunks = [c for c in oai.chat.completions.create(model="qwen35-format", messages=ASK, tools=[WEATHER_TOOL],
                                                     temperature=0, stream=True) if c.choices]
    thinking = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert thinking.strip() == THINKING and not "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [_call(t) for t in calls] == [("get_weather", ARGS)]
    assert wait_pool_empty(server.url)


def test_ollama_thinking_and_the_call_then_its_result_back(server, oll):
    reply = oll.chat(model="qwen35-format", messages=ASK, tools=[WEATHER_TOOL], think=True)
    assert reply.message.thinking.strip() == THINKING and not reply.message.content
    assert [(c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls] == [("get_weather", ARGS)]
    # the round trip: the call and its result rendered back in Qwen3.5's shape, and answered
    turn2 = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "content": "Sunny, 21 C"}]
    again = oll.chat(model="qwen35-format", messages=turn2, tools=[WEATHER_TOOL], think=True)
    assert again.message.thinking.strip() == THINKING
    streamed = list(oll.chat(model="qwen35-format", messages=turn2, tools=[WEATHER_TOOL], think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed).strip() == THINKING
    assert [c.function.name for p in streamed for c in (p.message.tool_calls or [])] == ["get_weather"]


def test_the_template_renders_an_earlier_call_as_xml():
    template = ChatTemplate(QWEN35_TEMPLATE)
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "content": "Sunny"}]
    tokenizer = scripted_tokenizer(THINK_THEN_CALL, QWEN35_TEMPLATE)
    assert tool_family(template, tokenizer) == "qwen_xml"   # a forced call is held to the XML
    prompt = str(render_chat(template, tokenizer, history, [WEATHER_TOOL]))
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" in prompt
    assert "<tool_response>\nSunny\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
