"""Gemma 4's chat format (tools/gemma4.py, the tiny file's template in testing/reference/tiny_gemma4.py):
its thinking channel comes back as thinking and its <|tool_call>call:NAME{...}<tool_call|> as a
tool call, whatever the cut into deltas; through the unmodified openai and ollama clients on tiny
real gemma4 models whose greedy reply is a script in Gemma 4's format (testing/scripted_gguf.py
with GEMMA4_MARKUP and arch="gemma4"), streamed and not, a tool-call round trip included; and the
tiny random-weight gemma4 model itself served with its template."""

import random

import openai
import pytest

from pyllama_paged import Llama
from pyllama_paged.calls.chat_call import split_as_streamed
from pyllama_paged.server.generation import Limits
from pyllama_paged.testing.chat_replies import chat_prompt_ids, llama_reply, ollama_reply, openai_reply
from pyllama_paged.testing.reference.tiny_gemma4 import GEMMA4_TEMPLATE, write_tiny_gemma4
from pyllama_paged.testing.scripted_gguf import GEMMA4_MARKUP, scripted_tokenizer, write_scripted_model
from pyllama_paged.testing.serving import model_server
from pyllama_paged.tokenizer.chat_template import ChatTemplate
from pyllama_paged.tokenizer.tokenizer import Tokenizer
from pyllama_paged.tools.gemma4 import parse_arguments, parse_gemma4_calls
from pyllama_paged.tools.prompt import tool_family
from pyllama_paged.tools.reasoning import split_reasoning, template_thinks, thinking_variables

HELLO = [{"role": "user", "content": "Hello"}]
THINKING = "The user greets me."
ANSWER = "Hello! How can I help?"
# one token a piece, none twice; generation ends at <turn|> (the EOS)
THINK_THEN_ANSWER = ["<|channel>", "thought\n", THINKING, "<channel|>", "Hello!", " How can I help?"]
CALL_THINKING = "The user wants the weather."
# the call, then <|tool_response>, where the result goes, ends the reply
THINK_THEN_CALL = ["<|channel>", "thought\n", CALL_THINKING, "<channel|>", "<|tool_call>",
                   'call:get_weather{city:<|"|>Paris<|"|>,days:2}', "<tool_call|>"]
RESULT_ANSWER = "It is 21 degrees in Paris."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
WEATHER_QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = '{"temperature": 21}'
# the call and its result in the model's turn, which the model goes on with
HISTORY = ('<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
           '<|tool_response>response:get_weather{value:<|"|>{"temperature": 21}<|"|>}<tool_response|>')

# -- the split and the notation, without a model --------------------------------------------------


@pytest.mark.parametrize("text,value", [
    ('{city:<|"|>Paris<|"|>,days:2}', {"city": "Paris", "days": 2}),
    ('{}', {}),
    ('{ a: -1.5e2 , b:[1,<|"|>x, y<|"|>,true,null] ,c:{d:false}}', {"a": -150.0, "b": [1, "x, y", True, None],
                                                                  "c": {"d": False}}),
    ('{q:<|"|>a "quoted": {json} text<|"|>}', {"q": 'a "quoted": {json} text'}),
])
def test_gemma4_argument_notation(text, value):
    assert parse_arguments(text) == value


@pytest.mark.parametrize("text", ['{city:Paris}', '{city:<|"|>Paris}', '{:1}', '{a:1', '[1]', '{a:1} x',
                                  "{a:" * 100 + "1" + "}" * 100])
def test_what_is_not_the_notation_is_refused(text):
    with pytest.raises(ValueError):
        parse_arguments(text)


def test_calls_after_answer_text_and_calls_not_offered():
    text = ('Let me look. <|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
            '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>')
    content, calls = parse_gemma4_calls(text, {"get_weather"})
    assert content == "Let me look." and calls == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert parse_gemma4_calls(text, {"other"}) is None
    # unreadable arguments leave the text as the model wrote it
    assert split_as_streamed("<|tool_call>call:get_weather{city:Oslo}<tool_call|>", {"get_weather"}) == \
        ("<|tool_call>call:get_weather{city:Oslo}<tool_call|>", [])


def test_every_cut_into_deltas_gives_the_same_split():
    from pyllama_paged.calls.chat_call import AnswerSplitter
    from pyllama_paged.calls.text_stream import TextDelta

    rng = random.Random(0)
    # a call alone after the thinking, and one after answer text (the text streams, the call does not)
    for reply, content in (("".join(THINK_THEN_CALL), ""),
                           ("".join(THINK_THEN_CALL[:4]) + "Let me look. " + "".join(THINK_THEN_CALL[4:]), "Let me look. ")):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(reply)), 6))
            pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
            splitter = AnswerSplitter({"get_weather"}, thinks=True)
            out = [splitter.feed(TextDelta(0, p, "stop" if i == len(pieces) - 1 else None))
                   for i, p in enumerate(pieces)]
            assert "".join(o.thinking for o in out) == CALL_THINKING and "".join(o.text for o in out).strip() == \
                content.strip()
            assert [(c.name, c.arguments) for c in out[-1].calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert split_reasoning("".join(THINK_THEN_ANSWER)) == (THINKING, ANSWER)
    # a channel opened later in the answer is answer text
    assert split_reasoning("Hi <|channel>thought\nx<channel|>") == ("", "Hi <|channel>thought\nx<channel|>")


def test_the_template_is_told_by_its_markup_and_takes_the_thinking_switch():
    template = ChatTemplate(GEMMA4_TEMPLATE)
    assert template_thinks(GEMMA4_TEMPLATE)
    tokenizer = scripted_tokenizer(THINK_THEN_ANSWER, GEMMA4_TEMPLATE, GEMMA4_MARKUP)
    assert tool_family(template, tokenizer) == "gemma4"
    on = template.render(HELLO, variables=thinking_variables(GEMMA4_TEMPLATE, True, None))
    off = template.render(HELLO, variables=thinking_variables(GEMMA4_TEMPLATE, False, None))
    assert on.startswith("<|turn>system\n<|think|><turn|>\n") and "<|think|>" not in off
    assert off.endswith("<|turn>user\nHello<turn|>\n<|turn>model\n")


# -- served: the clients ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-chat")

    def write(name, reply, end=None, after=None):
        # room for the tools' declaration, which the tiny vocabulary spells in many tokens
        return write_scripted_model(folder / f"{name}.gguf", reply, GEMMA4_TEMPLATE, markup=GEMMA4_MARKUP, end=end,
                                    after=after, context_length=1024, arch="gemma4")

    return {"thinker": write("thinker", THINK_THEN_ANSWER),
            "caller": write("caller", THINK_THEN_CALL, "<|tool_response>"),
            # after the tool's result the model goes on in its turn
            "answerer": write("answerer", [RESULT_ANSWER], after="<tool_response|>"),
            "gemma4": write_tiny_gemma4(folder / "gemma4.gguf", "dense", weight_type="f16")}


@pytest.fixture(scope="module")
def server(models):
    with model_server(list(models.values()), Limits(max_tokens=64), n_ctx=1024, n_threads=2, n_batch=128,
                      kv_tokens=4096, max_num_seqs=8) as s:
        yield s


def _prompt_ids(messages, **call_fields):
    tokenizer = scripted_tokenizer(THINK_THEN_ANSWER, GEMMA4_TEMPLATE, GEMMA4_MARKUP)
    return chat_prompt_ids(GEMMA4_TEMPLATE, tokenizer, messages, **call_fields), tokenizer


def test_openai_reasoning_content_and_answer_streamed_and_not(oai):
    for stream in (False, True):
        assert openai_reply(oai, "thinker", HELLO, stream, temperature=0) == (THINKING, ANSWER, [])
    out = oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(THINK_THEN_ANSWER) + 1   # the script and <turn|>
    pieces = [c.choices[0].delta for c in oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0,
                                                                      stream=True) if c.choices]
    assert not any("<|" in (d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")
                   for d in pieces)


def test_the_python_api_splits_the_thinking_too(models):
    with Llama(model_path=models["thinker"], n_ctx=1024, n_threads=2, verbose=False) as llm:
        for stream in (False, True):
            assert llama_reply(llm, HELLO, stream, temperature=0) == (THINKING, ANSWER)


def test_ollama_thinking_apart_and_the_switch_reaches_the_template(oll):
    for stream in (False, True):
        assert ollama_reply(oll, "thinker", HELLO, stream, think=True, options={"temperature": 0}) == \
            (THINKING, ANSWER, [])
    assert "thinking" in oll.show("thinker").capabilities
    on, _ = _prompt_ids(HELLO, thinking=True)
    off, _ = _prompt_ids(HELLO, thinking=False)
    assert oll.chat(model="thinker", messages=HELLO, think=True).prompt_eval_count == len(on) != len(off)
    assert oll.chat(model="thinker", messages=HELLO, think=False).prompt_eval_count == len(off)


CALLED = [("get_weather", {"city": "Paris", "days": 2})]


def test_a_tool_call_round_trips_through_openai(oai):
    for stream in (False, True):
        assert openai_reply(oai, "caller", [WEATHER_QUESTION], stream, tools=[WEATHER_TOOL], temperature=0) == \
            (CALL_THINKING, "", CALLED)
    first = oai.chat.completions.create(model="caller", messages=[WEATHER_QUESTION], tools=[WEATHER_TOOL],
                                        temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    # the client sends the call and its result back, as OpenAI's docs show
    followup = [WEATHER_QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": RESULT}]
    second = oai.chat.completions.create(model="answerer", messages=followup, tools=[WEATHER_TOOL], temperature=0)
    assert second.choices[0].message.content == RESULT_ANSWER
    ids, tokenizer = _prompt_ids(followup, tools=[WEATHER_TOOL])
    assert tokenizer.decode(ids).endswith(HISTORY) and second.usage.prompt_tokens == len(ids)


def test_a_tool_call_round_trips_through_ollama(oll):
    for stream in (False, True):
        assert ollama_reply(oll, "caller", [WEATHER_QUESTION], stream, tools=[WEATHER_TOOL], think=True,
                            options={"temperature": 0}) == (CALL_THINKING, "", CALLED)
    asked = oll.chat(model="caller", messages=[WEATHER_QUESTION], tools=[WEATHER_TOOL], options={"temperature": 0})
    followup = [WEATHER_QUESTION, asked.message, {"role": "tool", "content": RESULT, "tool_name": "get_weather"}]
    answered = oll.chat(model="answerer", messages=followup, tools=[WEATHER_TOOL], options={"temperature": 0})
    assert answered.message.content == RESULT_ANSWER


def test_a_forced_tool_choice_is_refused_clearly(oai):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="not supported yet for Gemma 4: use tool_choice 'auto'"):
            oai.chat.completions.create(model="caller", messages=[WEATHER_QUESTION], tools=[WEATHER_TOOL],
                                        tool_choice=choice, temperature=0)


def test_the_gemma4_model_answers_through_its_template(oai, models):
    """The tiny gemma4 file (random weights): its own template renders the chat, the engine runs it."""
    tokenizer = Tokenizer.from_gguf(models["gemma4"])
    ids = chat_prompt_ids(GEMMA4_TEMPLATE, tokenizer, [{"role": "system", "content": "Be brief."}, *HELLO])
    assert tokenizer.decode(ids) == "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHello<turn|>\n<|turn>model\n"
    out = oai.chat.completions.create(model="gemma4", messages=[{"role": "system", "content": "Be brief."}, *HELLO],
                                      max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == len(ids) and 1 <= out.usage.completion_tokens <= 8
