"""A thinking budget on every API (issue 54; llama.cpp's --reasoning-budget): past N thinking
tokens the think block's close is forced and the answer follows. Asked for as llama-server's
reasoning_budget_tokens / thinking_budget_tokens (OpenAI chat and the Responses API),
Anthropic's thinking.budget_tokens, a reasoning effort (Ollama's think levels, OpenAI's
reasoning_effort), or the server's --reasoning-budget for a request that sets none; through
the unmodified clients, on tiny real models whose greedy reply is a script
(testing/scripted_gguf.py): after a forced close the script goes on to its answer."""

import anthropic
import ollama
import openai
import pytest

from pyllama_paged import Llama
from pyllama_paged.constrain.thinking_budget import ThinkingBudget
from pyllama_paged.server.generation import Limits
from pyllama_paged.testing.scripted_gguf import OPEN_THINK_TEMPLATE, THINKING_TEMPLATE, write_scripted_model
from pyllama_paged.testing.serving import model_server

HELLO = [{"role": "user", "content": "Hello"}]
THOUGHTS = ["First,", " the", " user", " says", " hello."]   # one token each
THINKER = ["<think>", *THOUGHTS, "</think>", "\n\n", "Hi!"]
OPENER = ["Step one,", " step two,", " step three.", "</think>", "\n\n", "Hey."]   # the prompt opened the block
SERVER_BUDGET = 4


def thought(n: int) -> str:
    """The thinking of a block cut after n tokens."""
    return "".join(THOUGHTS[:n])


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("budget")
    return [write_scripted_model(folder / "thinker.gguf", THINKER, THINKING_TEMPLATE),
            write_scripted_model(folder / "opener.gguf", OPENER, OPEN_THINK_TEMPLATE)]


@pytest.fixture(scope="module")
def server(paths):
    with model_server(paths, Limits(max_tokens=64, reasoning_budget=SERVER_BUDGET), n_ctx=512, n_threads=2,
                      n_batch=128, kv_tokens=4096, max_num_seqs=8) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def openai_chat(oai, model="thinker", **extra) -> tuple[str, str]:
    """(thinking, answer) of a greedy chat completion."""
    message = oai.chat.completions.create(model=model, messages=HELLO, temperature=0, extra_body=extra
                                          ).choices[0].message
    return (message.model_extra or {}).get("reasoning_content") or "", message.content


def test_openai_chat_budget_by_either_name_and_the_servers_default(oai):
    assert openai_chat(oai) == (thought(SERVER_BUDGET), "Hi!")   # none asked: the server's
    assert openai_chat(oai, reasoning_budget_tokens=2) == (thought(2), "Hi!")
    assert openai_chat(oai, thinking_budget_tokens=1) == (thought(1), "Hi!")
    assert openai_chat(oai, reasoning_budget_tokens=0) == ("", "Hi!")
    assert openai_chat(oai, reasoning_budget_tokens=-1) == (thought(5), "Hi!")   # no budget
    assert openai_chat(oai, reasoning_effort="low") == (thought(5), "Hi!")       # low: 1024 tokens
    thinking = content = ""
    for chunk in oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0, stream=True,
                                             extra_body={"reasoning_budget_tokens": 2}):
        if chunk.choices:
            thinking += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (thinking, content) == (thought(2), "Hi!")
    with pytest.raises(openai.BadRequestError):
        openai_chat(oai, reasoning_budget_tokens=-2)
    # a model with a chat template: an unset length is the server's limit (a base model's is run's)
    rambling = oai.chat.completions.create(model="thinker", messages=HELLO, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert rambling.usage.completion_tokens == 64


def test_a_block_the_prompt_opened_counts_from_the_first_token(oai):
    assert openai_chat(oai, "opener", reasoning_budget_tokens=1) == ("Step one,", "Hey.")
    assert openai_chat(oai, "opener", reasoning_budget_tokens=-1) == ("Step one, step two, step three.", "Hey.")


def test_responses_budget(oai):
    out = oai.responses.create(model="thinker", input="Hello", temperature=0, extra_body={"reasoning_budget_tokens": 3})
    reasoning, message = out.output
    assert [c.text for c in reasoning.content] == [thought(3)] and out.output_text == "Hi!"


def test_anthropic_budget_tokens(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    out = claude.messages.create(model="thinker", max_tokens=64, messages=HELLO,
                                 thinking={"type": "enabled", "budget_tokens": 1})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == \
        [("thinking", thought(1)), ("text", "Hi!")]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(model="thinker", max_tokens=64, messages=HELLO,
                               thinking={"type": "enabled", "budget_tokens": "many"})


def test_ollama_think_levels_and_the_servers_default(server):
    oll = ollama.Client(host=server.url)
    greedy = {"temperature": 0}
    whole = oll.chat(model="thinker", messages=HELLO, think=True, options=greedy)
    assert (whole.message.thinking, whole.message.content) == (thought(SERVER_BUDGET), "Hi!")
    low = oll.chat(model="thinker", messages=HELLO, think="low", options=greedy)   # 1024 tokens
    assert (low.message.thinking, low.message.content) == (thought(5), "Hi!")
    generated = oll.generate(model="thinker", prompt="Hello", think=True, options=greedy)
    assert (generated.thinking, generated.response) == (thought(SERVER_BUDGET), "Hi!")


def test_the_python_api_takes_a_budget(paths):
    with Llama(paths[0], n_ctx=256, n_threads=2, verbose=False) as llm:
        for budget, thinking in ((2, thought(2)), (None, thought(5))):
            message = llm.create_chat_completion(HELLO, temperature=0, max_tokens=32,
                                                 reasoning_budget=budget)["choices"][0]["message"]
            assert (message.get("reasoning_content") or "", message["content"]) == (thinking, "Hi!")


def test_the_budget_state_forces_a_close_of_several_tokens_and_rearms():
    state = ThinkingBudget(2, open_ids=(7, 8), close_ids=(9, 10, 11)).start()
    forced = []
    for token in [1, 7, 8, 2, 3]:   # outside a block nothing is counted; 2 and 3 spend the budget
        assert state.forced is None
        state.accept(token)
    while state.forced is not None:
        forced.append(state.forced)
        state.accept(state.forced)
    assert forced == [9, 10, 11]
    for token in [4, 7, 8, 5, 9]:   # a second block: the budget afresh, spent as the model begins to close
        assert state.forced is None
        state.accept(token)
    assert state.forced == 10   # the close it began is finished, not begun again
    state.accept(10)
    state.accept(11)
    assert state.forced is None
    state = ThinkingBudget(3, open_ids=(7,), close_ids=(9, 10), opened=True).start()
    for token in [1, 9, 10, 2, 3, 4, 5]:   # opened by the prompt, closed by the model within its budget
        state.accept(token)
        assert state.forced is None
