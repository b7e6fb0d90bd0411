"""pyllama_paged/testing/scripted_gguf.py: tiny real qwen3 GGUFs whose greedy reply is a script
(thinking, answer, a tool call), run through the real engine, tokenizer and chat templates."""

import pytest

from pyllama_paged import Llama
from pyllama_paged.testing.scripted_gguf import (
    OPEN_THINK_TEMPLATE,
    THINKING_TEMPLATE,
    script_chain,
    scripted_tokenizer,
    write_scripted_model,
)
from pyllama_paged.tokenizer.chat_template import ChatTemplate
from pyllama_paged.tools.prompt import knows_tools

HELLO = [{"role": "user", "content": "Hello"}]
THINK_THEN_ANSWER = ["<think>", "\nThe user says hello.\n", "</think>", "\n\n", "Hello!", " How can I help?"]
# what the model writes after the prompt opened the think block itself
CLOSE_THEN_ANSWER = ["The user greets me.\n", "</think>", "\n\n", "Hi there!"]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THINK_THEN_CALL = ["<think>", "\nThe user wants the weather in Paris.\n", "</think>", "\n\n",
                   "<tool_call>", "\n" + CALL + "\n", "</tool_call>"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def load(tmp_path_factory, name: str, reply: list[str], template: str) -> Llama:
    path = write_scripted_model(tmp_path_factory.mktemp("scripted") / f"{name}.gguf", reply, template)
    return Llama(model_path=path, paged=True, n_ctx=512, n_threads=2, verbose=False)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    with load(tmp_path_factory, "thinker", THINK_THEN_ANSWER, THINKING_TEMPLATE) as llm:
        yield llm


@pytest.fixture(scope="module")
def open_thinker(tmp_path_factory):
    with load(tmp_path_factory, "open-thinker", CLOSE_THEN_ANSWER, OPEN_THINK_TEMPLATE) as llm:
        yield llm


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    with load(tmp_path_factory, "caller", THINK_THEN_CALL, THINKING_TEMPLATE) as llm:
        yield llm


def test_the_chat_reply_is_the_script_one_token_a_piece_then_end_of_turn(thinker):
    out = thinker.create_chat_completion(HELLO, temperature=0, max_tokens=32)
    choice = out["choices"][0]
    # the thinking comes apart from the answer (reasoning_content), as OpenAI-compatible servers send it
    assert choice["message"]["reasoning_content"] == "The user says hello."
    assert choice["message"]["content"] == "Hello! How can I help?"
    assert choice["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(THINK_THEN_ANSWER) + 1   # and <|im_end|>
    assert [thinker.token_eos()] == thinker.tokenize(b"<|im_end|>", add_bos=False, special=True)


def test_think_false_renders_the_template_without_thinking(thinker):
    for stream in (False, True):
        out = thinker.create_chat_completion(HELLO, temperature=0, max_tokens=32, think=False, stream=stream)
        messages = [c["choices"][0]["delta"] for c in out] if stream else [out["choices"][0]["message"]]
        assert "".join(m.get("content") or "" for m in messages) == "Hello! How can I help?"
        assert not any(m.get("reasoning_content") for m in messages)
    on = thinker.create_chat_completion(HELLO, temperature=0, max_tokens=32, think=True)
    assert on["choices"][0]["message"]["reasoning_content"] == "The user says hello."


def test_streamed_pieces_are_the_script_and_sampling_keeps_to_it(thinker):
    chunks = thinker.create_chat_completion(HELLO, temperature=0, max_tokens=32, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user says hello."
    assert [d["content"] for d in deltas if d.get("content")] == ["Hello!", " How can I help?"]
    # the next token's logit leads every other by 32: an ordinary temperature cannot leave the script
    sampled = thinker.create_chat_completion(HELLO, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    assert sampled["choices"][0]["message"]["content"] == "Hello! How can I help?"


def test_enable_thinking_false_renders_an_empty_think_block_and_the_model_answers_at_once(thinker):
    template = ChatTemplate(THINKING_TEMPLATE)
    assert template.render(HELLO).endswith("<|im_start|>assistant\n")
    assert template.render(HELLO, variables={"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    prompt = template.render(HELLO, variables={"enable_thinking": False})
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the prompt ends on the script's "\n\n", so the reply is the answer after the think block
    out = thinker.create_completion(str(prompt), temperature=0, max_tokens=32)
    assert out["choices"][0]["text"] == "Hello! How can I help?"
    with_thinking = thinker.create_completion(str(template.render(HELLO)), temperature=0, max_tokens=32)
    assert with_thinking["choices"][0]["text"] == "".join(THINK_THEN_ANSWER)


def test_a_prompt_that_opens_the_think_block_gets_thinking_without_an_opening_tag(open_thinker):
    prompt = ChatTemplate(OPEN_THINK_TEMPLATE).render(HELLO)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    text = "".join(CLOSE_THEN_ANSWER)
    assert open_thinker.create_completion(str(prompt), temperature=0, max_tokens=32)["choices"][0]["text"] == text
    chat = open_thinker.create_chat_completion(HELLO, temperature=0, max_tokens=32)
    message = chat["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user greets me.", "Hi there!")


def test_a_tool_call_after_the_thinking_comes_back_as_a_tool_call(caller):
    out = caller.create_chat_completion([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                                        temperature=0, max_tokens=32)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"] == '{"city": "Paris"}'
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants the weather in Paris." and not message["content"]
    raw = caller.create_completion(str(ChatTemplate(THINKING_TEMPLATE).render(HELLO, tools=[WEATHER_TOOL])),
                                   temperature=0, max_tokens=32)
    assert raw["choices"][0]["text"] == "".join(THINK_THEN_CALL)


@pytest.mark.parametrize("source", [THINKING_TEMPLATE, OPEN_THINK_TEMPLATE])
def test_both_templates_render_tools_and_tool_history_themselves(source):
    template = ChatTemplate(source)
    assert knows_tools(template)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\n",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    text = template.render(history, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert "<|im_start|>assistant\n<tool_call>\n" + CALL + "\n</tool_call><|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert "Look it up." not in text   # earlier turns' thinking is dropped, as Qwen3's template does
    assert template.render(HELLO).startswith("<|im_start|>user\nHello<|im_end|>\n")


def test_the_chain_starts_at_the_prompts_last_token_and_refuses_a_repeat():
    tokenizer = scripted_tokenizer(THINK_THEN_ANSWER, THINKING_TEMPLATE)
    chain = script_chain(THINK_THEN_ANSWER, THINKING_TEMPLATE)
    assert [tokenizer.decode([t]) for t in chain] == ["\n"] + THINK_THEN_ANSWER + ["<|im_end|>"]
    no_thinking = script_chain(["Hello!"], THINKING_TEMPLATE, {"enable_thinking": False})
    assert tokenizer.decode(no_thinking[:1]) == "\n\n"
    with pytest.raises(ValueError, match="twice"):
        script_chain(["<think>", "\n", "</think>"], THINKING_TEMPLATE)   # "\n" ends the prompt already


def test_a_gemma4_script_is_followed_under_its_soft_cap_when_sampled(tmp_path):
    """arch="gemma4": the script in tiny_gemma4's dense shape (shared KV, per-layer embeddings,
    output scales, a soft-cap of 30 on the script's logit), sampled at temperature 1."""
    from pyllama_paged.testing.reference.tiny_gemma4 import GEMMA4_TEMPLATE
    from pyllama_paged.testing.scripted_gguf import GEMMA4_MARKUP

    reply = ["<|channel>", "thought\n", "The user greets me.", "<channel|>", "Hello!", " How can I help?"]
    path = write_scripted_model(tmp_path / "gemma4.gguf", reply, GEMMA4_TEMPLATE, markup=GEMMA4_MARKUP,
                                context_length=512, arch="gemma4")
    with Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False) as llm:
        assert llm.metadata["general.architecture"] == "gemma4"
        for seed in range(3):
            out = llm.create_chat_completion(HELLO, temperature=1.0, seed=seed, max_tokens=16)["choices"][0]
            assert (out["message"]["reasoning_content"], out["message"]["content"]) == \
                ("The user greets me.", "Hello! How can I help?")
