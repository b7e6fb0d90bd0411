"""Tool calling (issue 14, item 2): calls parsed from each template family's
output (whole and streamed), tools rendered through the chat template as
transformers passes them, forced calls held to a grammar, and the round trip
through the server and the Python API on the default model."""

import json

import jsonschema
import numpy as np
import openai
import pytest

from pyllama_paged.testing.serving import default_model_server, wait_pool_empty
from pyllama_paged.constrain.grammar import ConstraintError
from pyllama_paged.constrain.masks import MaskBuffer
from pyllama_paged.api.llama import Llama
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.tokenizer.chat_template import ChatTemplate
from pyllama_paged.tokenizer.tokenizer import Tokenizer
from pyllama_paged.tools.calls import ToolCallStream, parse_tool_calls
from pyllama_paged.tools.messages import normalize_messages
from pyllama_paged.tools.prompt import forced_call_constraint, prepare_chat, render_chat, tool_family

M = DEFAULT_MODEL_NAME
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
NAMES = {"get_weather", "get_time"}
PARIS = {"city": "Paris", "unit": "C"}


# ---- parsing, per family ------------------------------------------------------
@pytest.mark.parametrize("text,content", [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
     "Let me look."),                                                                         # Qwen / Hermes
    ('Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
     '<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>', "Let me look."),           # Qwen3.5 (XML)
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', ""),  # Llama 3.x
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', ""),             # Llama 3.x, bare
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]', ""),  # Mistral
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n```', ""),  # Gemma-style
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}', ""),  # args as text
    ('```tool_code\nget_weather(city="Paris", unit="C")\n```', ""),                         # Gemma tool_code
    ("```tool_code\nprint(default_api.get_weather(city='Paris', unit='C'))\n```", ""),       # ... as Gemma prints it
])
def test_calls_are_parsed_whole_and_streamed(text, content):
    left, calls = parse_tool_calls(text, NAMES)
    assert left == content and [(c.name, c.arguments) for c in calls] == [("get_weather", PARIS)]
    stream = ToolCallStream(NAMES)
    streamed = "".join(stream.feed(ch) for ch in text)
    rest, calls = stream.finish()
    assert (streamed + rest).strip() == content and [c.name for c in calls] == ["get_weather"]
    assert calls[0].openai()["function"]["arguments"] == json.dumps(PARIS)


def test_qwen35_xml_calls_and_what_is_not_one():
    """Qwen3.5's template asks for <function=NAME> with one <parameter=KEY> per argument inside
    <tool_call>: several blocks are several calls, a value that reads as JSON (not a string)
    is that value, a multi-line value keeps its lines; an unknown function, text between the
    parameters or a parameter left open is content, streamed as such."""
    text = ("<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nSao\nPaulo\n</parameter>\n"
            "<parameter=days>\n[1, 2]\n</parameter>\n<parameter=unit>\nnull\n</parameter>\n</function>\n</tool_call>")
    want = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Sao\nPaulo", "days": [1, 2], "unit": None})]
    left, calls = parse_tool_calls(text, NAMES)
    assert left == "" and [(c.name, c.arguments) for c in calls] == want
    stream = ToolCallStream(NAMES)
    streamed = "".join(stream.feed(ch) for ch in text)
    rest, calls = stream.finish()
    assert (streamed + rest).strip() == "" and [(c.name, c.arguments) for c in calls] == want
    for bad in ("<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
                "<tool_call>\n<function=get_time>\nnow <parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
                "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</function>\n</tool_call>"):
        assert parse_tool_calls(bad, NAMES) == (bad, [])
        stream = ToolCallStream(NAMES)
        streamed = "".join(stream.feed(ch) for ch in bad)
        rest, calls = stream.finish()
        assert streamed + rest == bad and not calls
    # a name no tool has stops holding the text as soon as it cannot be one
    stream = ToolCallStream(NAMES)
    assert stream.feed("<tool_call>\n<function=rm") == "<tool_call>\n<function=rm"


def test_several_calls_and_things_that_are_not_calls():
    _, calls = parse_tool_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}', NAMES)
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    for text in ("Hello there!", '{"a": 1}', '{"name": "rm_rf", "arguments": {}}', "[1, 2]", "{broken"):
        assert parse_tool_calls(text, NAMES) == (text, [])
        stream = ToolCallStream(NAMES)
        streamed = "".join(stream.feed(ch) for ch in text)
        rest, calls = stream.finish()
        assert streamed + rest == text and not calls
    _, calls = parse_tool_calls('```tool_code\nget_time(zone="UTC")\nget_weather(city="Oslo", unit="C")\n```', NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", {"zone": "UTC"}),
                                                      ("get_weather", {"city": "Oslo", "unit": "C"})]
    _, calls = parse_tool_calls('```tool_code\nget_weather(city="Oslo", unit=None, days=[1, 2], ok=true)\n```', NAMES)
    assert calls[0].arguments == {"city": "Oslo", "unit": None, "days": [1, 2], "ok": True}
    # never run, only read: anything but keyword literals to a named tool stays content
    for code in ('get_weather("Paris", "C")', 'rm_rf(path="/")', 'get_weather(city=open("/etc/passwd").read())',
                 'get_weather(**{"city": "x"})', 'x = get_weather(city="P")', "get_weather(city=", "import os"):
        text = f"```tool_code\n{code}\n```"
        assert parse_tool_calls(text, NAMES) == (text, [])
    stream = ToolCallStream(NAMES)   # plain text streams at once, not at the end
    assert stream.feed("Sure") == "Sure" and stream.feed(", <tool") == ", " and stream.feed("bar>") == "<toolbar>"


def _stream(text, names=NAMES):
    """(content streamed, the characters fed before the first content, calls, the stream) for
    text fed one character at a time until the stream is done."""
    stream, out, first = ToolCallStream(names), [], None
    for k, ch in enumerate(text):
        piece = stream.feed(ch)
        if piece and first is None:
            first = k + 1
        out.append(piece)
        if stream.done:
            break
    rest, calls = stream.finish()
    return "".join(out) + rest, first, [(c.name, c.arguments) for c in calls], stream


@pytest.mark.parametrize("call", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]',
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n```',
    '```tool_code\nget_weather(city="Paris", unit="C")\n```',
])
def test_a_call_then_text_ends_the_answer_with_the_call(call):
    """Whole-text parsing once read a call followed by text as plain text; the stream stops
    at the first character after the call that no call goes on with, and drops it."""
    trailing = "\n\nThe weather in Paris is sunny."
    content, _, calls, stream = _stream(call + trailing)
    assert (content, calls) == ("", [("get_weather", PARIS)])
    assert stream.done and stream.dropped == len("\n\nT")


def test_calls_one_after_another_are_all_read_before_the_end():
    hermes = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>')
    llama = ('{"name": "get_time", "parameters": {"zone": "UTC"}}; '
             '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}')
    for text in (hermes, llama):
        content, _, calls, stream = _stream(text + " Done.")
        assert [name for name, _ in calls] == ["get_time", "get_weather"] and not content and stream.done


@pytest.mark.parametrize("text,told_after", [
    ('{"answer": 42, "name": "get_weather"}', 4),      # a key no call has
    ('{"name": "Alice", "age": 36}', 11),              # a name no tool has
    ('{"name": "get_weatherman", "arguments": {}}', 22),
    ('[1, 2, 3]', 2), ('[TOOL', 6),                    # an array of no calls; not a marker
    ('```python\nprint(1)\n```', 11),                 # a fence of code that is no JSON
    ("<b>bold</b>", 2), ("{broken", 2),
    ('{"name": "get_weather", "arguments": {}, "x": 1}', 43),   # a key after the call's own
])
def test_text_that_cannot_be_a_call_streams_once_it_cannot(text, told_after):
    content, first, calls, _ = _stream(text + " and more")
    assert (content, calls) == (text + " and more", [])
    assert first == told_after   # let through at the character that told, not at the end
    assert parse_tool_calls(text, NAMES) == (text, [])   # and the whole answer reads the same


# ---- rendering ----------------------------------------------------------------
# A template of our own in the shape of the tool-aware ones GGUF files carry.
TOOL_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{{ m.content }}</{{ m.role }}>\n{% endfor %}<assistant>")


def test_tools_reach_a_tool_aware_template_as_transformers_passes_them():
    tok = Tokenizer(["a", "<tool_call>"], token_types=[1, 4])
    template = ChatTemplate(TOOL_TEMPLATE)
    messages = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    text = render_chat(template, tok, messages, TOOLS)
    assert "<tools>get_weather:" in text and '"maxLength": 20' in text
    assert '<tool_call>get_weather{"city": "Paris", "unit": "C"}</tool_call>' in text   # arguments as an object
    assert "<tool>18 C</tool>" in text and tool_family(template, tok) == "hermes"


def test_templates_without_tools_get_them_described(llm):
    messages = normalize_messages([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c1", "function": {"name": "get_weather", "arguments": PARIS}}]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    text = render_chat(llm.chat_template, llm._tokenizer, messages, TOOLS)
    assert tool_family(llm.chat_template, llm._tokenizer) == "json"
    assert "Be brief." in text and "get_time" in text and "Result of get_weather: 18 C" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in text


# How a model of each tool family writes a call: the text before the arguments object (of the
# function NAME) and the text after it.
CALL_WRAPPERS = {
    "hermes": ('<tool_call>\n{"name":"NAME","arguments":', '}\n</tool_call>'),
    "llama3": ('{"name":"NAME","parameters":', '}'),
    "mistral": ('[{"name":"NAME","arguments":', '}]'),
    "json": ('{"name":"NAME","arguments":', '}'),
}


# Qwen3.5's XML calls name each parameter instead of writing a JSON object: the whole call of
# get_time(zone="CET"), and the text before count's number n.
QWEN_XML = {"get_time": "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
            "count": "<tool_call>\n<function=count>\n<parameter=n>\n"}


def call_text(family: str, name: str, arguments: str, whole: bool = True) -> str:
    """A call of `name` as a `family` model writes it; without its closing text unless whole
    (qwen_xml: QWEN_XML's text of name)."""
    if family == "qwen_xml":
        return QWEN_XML[name]
    before, after = CALL_WRAPPERS[family]
    return before.replace("NAME", name) + arguments + (after if whole else "")


@pytest.mark.parametrize("family", [*CALL_WRAPPERS, "qwen_xml"])
def test_forced_call_grammar_admits_a_call_then_the_end(llm, family):
    tok = llm._tokenizer
    answer = call_text(family, "get_time", '{"zone":"CET"}')
    state = forced_call_constraint(tok, family, TOOLS).start()
    buffer = MaskBuffer(tok.n_vocab)
    for token in tok.encode(answer, add_special=False):
        assert buffer.fill([state])[0][token], (family, tok.tokens[token])
        state.accept(token)
    assert set(np.flatnonzero(buffer.fill([state])[0])) == set(tok.eot_ids)
    assert parse_tool_calls(answer, NAMES)[1][0].arguments == {"zone": "CET"}
    only = forced_call_constraint(tok, family, TOOLS, only="get_weather").start()
    first = tok.encode(answer, add_special=False)
    for token in first:   # a call to the other function is refused somewhere along the way
        if not buffer.fill([only])[0][token]:
            break
        only.accept(token)
    else:
        pytest.fail("a call to get_time passed a grammar for get_weather only")


COUNT = {"type": "function", "function": {
    "name": "count", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
                                    "required": ["n", "x"]}}}


@pytest.mark.parametrize("family,numbers", [
    ("qwen_xml", ""), ("hermes", '{"n":'), ("llama3", '{"n":1,"x":0.'), ("mistral", '{"n":'), ("json", '{"n":1,"x":')])
def test_a_forced_calls_numbers_take_at_most_16_digits(llm, family, numbers):
    tok = llm._tokenizer
    state = forced_call_constraint(tok, family, [COUNT]).start()
    for token in tok.encode(call_text(family, "count", numbers, whole=False), add_special=False):
        state.accept(token)
    buffer, nine = MaskBuffer(tok.n_vocab), tok.encode("9", add_special=False)[0]
    written = 0
    while written < 40 and buffer.fill([state])[0][nine]:
        state.accept(nine)
        written += 1
    assert written == 16


def test_tool_choice_errors(llm):
    for tools, choice, needle in ((TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among"),
                                  ([], "required", "no tools"), (TOOLS, "sometimes", "not none, auto"),
                                  ([{"type": "function"}], "auto", r"tools\[0\]")):
        with pytest.raises(ConstraintError, match=needle):
            prepare_chat(llm.chat_template, llm._tokenizer, [{"role": "user", "content": "x"}], tools, choice)


# ---- the round trip on the default model --------------------------------------
@pytest.fixture(scope="module")
def llm():
    with Llama(n_ctx=1024, n_threads=2) as model:
        yield model


@pytest.fixture(scope="module")
def server():
    with default_model_server(Limits(max_tokens=200), n_ctx=1024, n_threads=2, n_batch=256, block_size=32,
                              kv_budget_tokens=8192, max_num_seqs=16) as running:
        yield running


def _check_call(name, arguments):
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, schema)


def test_python_api_forced_tool_call(llm):
    out = llm.create_chat_completion([{"role": "user", "content": "What is the weather in Paris?"}],
                                     tools=TOOLS, tool_choice="required", max_tokens=100, seed=2)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    _check_call(call["name"], call["arguments"])
    chunks = list(llm.create_chat_completion([{"role": "user", "content": "What time is it?"}], tools=TOOLS,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}},
                                             max_tokens=100, seed=3, stream=True))
    calls = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in calls] == ["get_time"]
    _check_call("get_time", calls[0]["function"]["arguments"])
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["tool_calls"]


def test_openai_forced_and_named_tool_calls_round_trip(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}]):
        r = client.chat.completions.create(model=M, messages=messages, tools=TOOLS, tool_choice=choice,
                                           max_tokens=100, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        _check_call(call.function.name, call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
    # the call goes back with its result: the conversation continues
    follow = messages + [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = client.chat.completions.create(model=M, messages=follow, tools=TOOLS, max_tokens=5)
    assert again.choices[0].message.role == "assistant"
    # streamed: the call arrives as tool_calls deltas, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(model=M, messages=messages, tools=TOOLS, tool_choice="required",
                                                 max_tokens=100, seed=5, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and deltas
    _check_call(deltas[0].function.name, deltas[0].function.arguments)
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert wait_pool_empty(server.url)


def test_a_model_that_prefers_digits_ends_its_forced_call_and_its_json_over_http(server, llm):
    """logit_bias makes every digit the model's first choice: without a bound on a number's
    digits it writes them until max_tokens and nothing parses."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    tok = llm._tokenizer
    bias = {str(tok.encode(str(d), add_special=False)[0]): 100 for d in range(10)}
    messages = [{"role": "user", "content": "Count to three."}]
    r = client.chat.completions.create(model=M, messages=messages, tools=[COUNT], tool_choice="required",
                                       max_tokens=120, seed=1, logit_bias=bias)
    assert r.choices[0].finish_reason == "tool_calls"
    arguments = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, COUNT["function"]["parameters"])
    assert len(str(arguments["n"])) == 16
    schema = COUNT["function"]["parameters"]
    r = client.chat.completions.create(model=M, messages=messages, max_tokens=120, seed=2, logit_bias=bias,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "count", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_ollama_tool_call_round_trip(server):
    import ollama

    client = ollama.Client(host=server.url)
    # Ollama has no tool_choice: a format holding the answer to a call's shape makes the
    # default base model call; the answer comes back as message.tool_calls
    call_format = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                    "arguments": WEATHER["function"]["parameters"]},
                   "required": ["name", "arguments"]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat(model=M, messages=messages, tools=TOOLS, format=call_format, options={"seed": 1})
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather" and not r.message.content
    _check_call(call.name, dict(call.arguments))
    streamed = list(client.chat(model=M, messages=messages, tools=TOOLS, format=call_format, stream=True,
                                options={"seed": 2}))
    calls = [c for part in streamed for c in (part.message.tool_calls or [])]
    assert len(calls) == 1 and streamed[-1].done
    follow = messages + [r.message.model_dump(exclude_none=True),
                         {"role": "tool", "content": "18 C", "tool_name": "get_weather"}]
    assert client.chat(model=M, messages=follow, tools=TOOLS, options={"num_predict": 5}).done
