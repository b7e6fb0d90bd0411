"""A reasoning model's thinking comes back apart from its answer (Ollama's message.thinking
and generate's thinking, OpenAI-style reasoning_content, the Responses API's reasoning item,
Anthropic's thinking block, the chat CLI's dimmed or hidden thinking), streamed and not,
through the unmodified ollama, openai and anthropic clients, on tiny real models whose greedy
reply is a script (testing/scripted_gguf.py); the request's switch (think, enable_thinking,
reasoning_effort, reasoning.effort, thinking) renders the template without thinking, and a
tool call after the thinking comes back as a tool call."""

import json

import os
import pty
import subprocess
import sys

import anthropic
import ollama
import openai
import pytest

from pyllama_paged.server.generation import Limits
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.scripted_gguf import OPEN_THINK_TEMPLATE, THINKING_TEMPLATE, write_scripted_model
from pyllama_paged.testing.serving import model_server

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
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinkers")
    return {"thinker": write_scripted_model(folder / "thinker.gguf", THINK_THEN_ANSWER, THINKING_TEMPLATE),
            "opener": write_scripted_model(folder / "opener.gguf", CLOSE_THEN_ANSWER, OPEN_THINK_TEMPLATE),
            "caller": write_scripted_model(folder / "caller.gguf", THINK_THEN_CALL, THINKING_TEMPLATE)}


@pytest.fixture(scope="module")
def server(models):
    with model_server(list(models.values()), Limits(max_tokens=64), n_ctx=512, n_threads=2, n_batch=128,
                      kv_tokens=4096, max_num_seqs=8) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


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


def test_ollama_generate_thinking_apart_from_the_response(oll):
    whole = oll.generate(model="thinker", prompt="Hello", think=True, options={"temperature": 0})
    assert (whole.thinking, whole.response) == (THINKING, ANSWER)
    pieces = list(oll.generate(model="thinker", prompt="Hello", think="high", stream=True,
                               options={"temperature": 0}))
    assert ("".join(p.thinking or "" for p in pieces), "".join(p.response for p in pieces)) == (THINKING, ANSWER)
    off = oll.generate(model="thinker", prompt="Hello", think=False, options={"temperature": 0})
    assert (off.thinking, off.response) == (None, ANSWER)
    with pytest.raises(ollama.ResponseError, match="think must be"):
        oll.generate(model="thinker", prompt="Hello", think="very")


def test_responses_reasoning_item_before_the_message(oai):
    whole = oai.responses.create(model="thinker", input="Hello", temperature=0)
    reasoning, message = whole.output
    assert (reasoning.type, reasoning.summary, [c.text for c in reasoning.content]) == ("reasoning", [], [THINKING])
    assert message.type == "message" and whole.output_text == ANSWER
    # the thinking's tokens are counted apart (they are part of output_tokens)
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
    events = list(oai.responses.create(model="thinker", input="Hello", temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [THINKING]
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == THINKING
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens
    # the reasoning item passed back in the next turn's input is read past, as OpenAI asks clients to send it
    again = oai.responses.create(model="thinker", temperature=0, input=[
        {"role": "user", "content": "Hello"}, whole.output[0].model_dump(exclude_none=True),
        {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Hello"}])
    assert again.output_text == ANSWER
    off = oai.responses.create(model="thinker", input="Hello", temperature=0, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == ANSWER
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_anthropic_thinking_block_only_when_asked(claude):
    # the script's logit leads every other's by 32: sampling at Anthropic's temperature 1 keeps to it
    enabled = {"type": "enabled", "budget_tokens": 1024}
    whole = claude.messages.create(model="thinker", max_tokens=64, messages=HELLO, thinking=enabled)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert (whole.content[0].thinking, whole.content[1].text) == (THINKING, ANSWER)
    with claude.messages.stream(model="thinker", max_tokens=64, messages=HELLO, thinking=enabled) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "thinking_delta" in kinds and kinds.index("thinking_delta") < kinds.index("text_delta")
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == \
        [("thinking", THINKING), ("text", ANSWER)]
    # Claude thinks only when asked: thinking off renders the template without it
    for extra in ({}, {"thinking": {"type": "disabled"}}):
        plain = claude.messages.create(model="thinker", max_tokens=64, messages=HELLO, **extra)
        assert [(b.type, b.text) for b in plain.content] == [("text", ANSWER)]
    # a template with no switch thinks anyway: a client that did not ask still reads its text first
    opened = claude.messages.create(model="opener", max_tokens=64, messages=HELLO)
    assert [(b.type, b.text) for b in opened.content] == [("text", "Hi there!")]
    omitted = claude.messages.create(model="opener", max_tokens=64, messages=HELLO,
                                     thinking={**enabled, "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content] == [("thinking", ""), ("text", None)]


def test_chat_cli_labels_or_hides_the_thinking(models):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def chat(*flags):
        p = subprocess.run([sys.executable, "-m", "pyllama_paged.cli", "chat", "--model", models["thinker"],
                            "--threads", "2", "--ctx", "512", "--temperature", "0", *flags],
                           input="Hello\n/exit\n", capture_output=True, text=True, timeout=300, env=env, cwd="/")
        assert p.returncode == 0, p.stderr
        return p.stdout.split("> ", 1)[1]

    # not a terminal: a label, no ANSI codes
    assert chat().startswith(f"[thinking] {THINKING}\n\n{ANSWER}\n")
    assert chat("--hide-thinking").startswith(f"{ANSWER}\n")
    # a terminal: the thinking dimmed
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "pyllama_paged.cli", "chat", "--model", models["thinker"],
                          "--threads", "2", "--ctx", "512", "--temperature", "0"],
                         stdin=subprocess.PIPE, stdout=follower, stderr=subprocess.DEVNULL, env=env, cwd="/")
    os.close(follower)
    p.communicate(b"Hello\n/exit\n", timeout=300)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:   # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert f"\033[2m{THINKING}\033[0m\n\n{ANSWER}".replace("\n", "\r\n").encode() in seen


def test_a_model_that_does_not_think_still_refuses_think(tmp_path):
    path = write_tiny_model(tmp_path / "plain.gguf", "gemma3", weight_type="q8_0")
    with model_server([path], Limits(max_tokens=8), n_ctx=256, n_threads=1, kv_tokens=1024, max_num_seqs=2) as s:
        client = ollama.Client(host=s.url)
        with pytest.raises(ollama.ResponseError, match="does not support thinking"):
            client.chat(model="plain", messages=HELLO, think=True)
        assert "thinking" not in client.show("plain").capabilities
