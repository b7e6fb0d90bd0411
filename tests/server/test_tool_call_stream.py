"""A tool call the answer opens with ends the answer (issue 54, item 2): once it is complete and
text that is no call follows, the request finishes with the call (finish_reason tool_calls, the
text after it dropped) and the generation stops there, its pages freed; and an answer that opens
like a call (`{`) but cannot be one streams at once, not at its end. Through the unmodified
openai, ollama and anthropic clients and the Python API, on tiny real models whose greedy reply
is a script (testing/scripted_gguf.py); how far a script was generated is read from the usage
counts, and how early text streamed from the order and number of chunks, never from timings."""

import json

import anthropic
import pytest

from pyllama_paged import Llama
from pyllama_paged.server.generation import Limits
from pyllama_paged.testing.scripted_gguf import THINKING_TEMPLATE, write_scripted_model
from pyllama_paged.testing.serving import model_server, wait_pool_empty

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# Qwen's tags, then text the model should never have written: generation stops at its first token
HERMES_THEN_TEXT = ["<tool_call>", "\n" + json.dumps(CALL) + "\n", "</tool_call>", "\n\nIt is", " sunny",
                    " in Paris."]
# a bare JSON call (Llama 3.x, Gemma), then text: once returned as plain text
JSON_THEN_TEXT = [json.dumps(CALL), "\n\nThe weather", " is sunny", " today."]
# JSON that is no call: let through from its first key on
NOT_A_CALL = ["{", '"answer"', ": 42", ', "note"', ': "', "not", " a", " call", " at", " all", '"', "}"]
# a call's shape naming a tool the request did not offer: let through from its name on
UNKNOWN_TOOL = ['{"name": "', "delete_everything", '", "arguments": {}}', " and", " some", " more"]
CALL_TOKENS = {"hermes": 3, "json": 1}   # each script's tokens up to the end of its call
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("callers")
    scripts = {"hermes": HERMES_THEN_TEXT, "json": JSON_THEN_TEXT, "answer": NOT_A_CALL, "unknown": UNKNOWN_TOOL}
    written = {name: write_scripted_model(folder / f"{name}.gguf", reply, THINKING_TEMPLATE)
               for name, reply in scripts.items()}
    # Anthropic's Messages without `thinking` switch the template's thinking off: its prompt
    # ends after an empty think block, where these scripts start
    for name in ("hermes", "json"):
        written[f"{name}-no-thinking"] = write_scripted_model(
            folder / f"{name}-no-thinking.gguf", scripts[name], THINKING_TEMPLATE,
            variables={"enable_thinking": False})
    return written


@pytest.fixture(scope="module")
def server(models):
    with model_server(list(models.values()), Limits(max_tokens=64), n_ctx=512, n_threads=2, n_batch=128,
                      kv_tokens=4096, max_num_seqs=8) as s:
        yield s


def _call(c):
    return c.function.name, json.loads(c.function.arguments)


@pytest.mark.parametrize("model", ["hermes", "json"])
def test_a_call_then_text_is_a_call_and_generation_stops_there(server, oai, model):
    out = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [_call(c) for c in choice.message.tool_calls] == [("get_weather", CALL["arguments"])]
    # the call's tokens and the first of the text after it; the rest of the script never ran
    assert out.usage.completion_tokens == CALL_TOKENS[model] + 1
    chunks = [c for c in oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL],
                                                     temperature=0, stream=True) if c.choices]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [_call(t) for t in calls] == [("get_weather", CALL["arguments"])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert wait_pool_empty(server.url)   # the stopped generation gave its pages back


@pytest.mark.parametrize("model", ["hermes", "json"])
def test_a_call_then_text_is_a_call_on_ollama_anthropic_and_responses(server, oll, oai, model):
    for stream in (False, True):
        parts = oll.chat(model=model, messages=ASK, tools=[WEATHER_TOOL], stream=stream, options={"temperature": 0})
        parts = list(parts) if stream else [parts]
        calls = [(c.function.name, dict(c.function.arguments)) for p in parts for c in (p.message.tool_calls or [])]
        assert calls == [("get_weather", CALL["arguments"])]
        assert not "".join(p.message.content or "" for p in parts)
        assert parts[-1].done and parts[-1].eval_count == CALL_TOKENS[model] + 1
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    message = claude.messages.create(model=f"{model}-no-thinking", max_tokens=64, messages=ASK, tools=[tool])
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [("get_weather", CALL["arguments"])]
    assert not [b for b in message.content if b.type == "text" and b.text]
    response = oai.responses.create(model=model, input="What is the weather in Paris?", temperature=0,
                                    tools=[{"type": "function", **WEATHER_TOOL["function"]}])
    assert [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"] == \
        [("get_weather", CALL["arguments"])]
    assert wait_pool_empty(server.url)


@pytest.mark.parametrize("model,script", [("answer", NOT_A_CALL), ("unknown", UNKNOWN_TOOL)])
def test_an_answer_that_opens_like_a_call_but_is_none_streams_at_once(oai, oll, model, script):
    text = "".join(script)
    out = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    assert (out.choices[0].message.content, out.choices[0].message.tool_calls) == (text, None)
    chunks = [c for c in oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER_TOOL],
                                                     temperature=0, stream=True) if c.choices]
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(contents) == text
    # held only until it could not be a call (two tokens), then a chunk per token, before the end
    assert len(contents) >= len(script) - 2
    first = next(k for k, c in enumerate(chunks) if c.choices[0].delta.content)
    assert first < len(chunks) - len(script) + 2
    parts = list(oll.chat(model=model, messages=ASK, tools=[WEATHER_TOOL], stream=True, options={"temperature": 0}))
    assert "".join(p.message.content for p in parts) == text
    assert len([p for p in parts if p.message.content]) >= len(script) - 2


def test_the_python_api_stops_at_the_call_and_streams_a_non_call(models):
    with Llama(model_path=models["json"], n_ctx=512, n_threads=2, verbose=False) as llm:
        out = llm.create_chat_completion(ASK, tools=[WEATHER_TOOL], temperature=0)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        call = choice["message"]["tool_calls"][0]["function"]
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", CALL["arguments"])
        assert out["usage"]["completion_tokens"] == CALL_TOKENS["json"] + 1
    with Llama(model_path=models["answer"], n_ctx=512, n_threads=2, verbose=False) as llm:
        chunks = list(llm.create_chat_completion(ASK, tools=[WEATHER_TOOL], temperature=0, stream=True))
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0]["delta"].get("content")]
        assert "".join(contents) == "".join(NOT_A_CALL) and len(contents) >= len(NOT_A_CALL) - 2
