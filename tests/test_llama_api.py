"""The llama-cpp-python-shaped API on the default model: completions, streaming,
stop strings, seeds, logprobs, echo, errors."""

import pytest

from pyllama_paged.errors import PagedError
from pyllama_paged.llama import Llama
from pyllama_paged.text_stream import StopMatcher


@pytest.fixture(scope="module")
def llm():
    with Llama(n_ctx=256, n_threads=2) as model:
        yield model


def test_completion_shape_and_usage(llm):
    out = llm("The capital of France is", max_tokens=8, temperature=0)
    assert out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}


def test_stream_concatenates_to_the_same_text(llm):
    full = llm("Once upon a time", max_tokens=12, temperature=0)["choices"][0]["text"]
    chunks = list(llm("Once upon a time", max_tokens=12, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_string_cuts_text(llm):
    full = llm("The capital of France is", max_tokens=16, temperature=0)["choices"][0]["text"]
    stop = full.split()[2]
    out = llm("The capital of France is", max_tokens=16, temperature=0, stop=[stop])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == full[:full.index(stop)]


def test_seed_reproduces_sampling(llm):
    kw = dict(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = llm("Tell me a story", seed=11, **kw)["choices"][0]["text"]
    b = llm("Tell me a story", seed=11, **kw)["choices"][0]["text"]
    c = llm("Tell me a story", seed=12, **kw)["choices"][0]["text"]
    assert a == b and a != c


def test_logprobs_and_echo(llm):
    out = llm("Hello", max_tokens=4, temperature=0, logprobs=3, echo=True)
    choice = out["choices"][0]
    assert choice["text"].startswith("Hello")
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and all(x <= 0 for x in lp["token_logprobs"])
    assert all(len(t) == 3 for t in lp["top_logprobs"])
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen == pytest.approx(max(top.values()))


def test_tokenize_detokenize_roundtrip(llm):
    text = "Héllo wörld 你好 🙂\n\tcode()"
    ids = llm.tokenize(text)
    assert ids[0] == 2
    assert llm.detokenize(ids).decode() == text


def test_over_long_prompt_is_a_clear_error_and_model_keeps_working(llm):
    with pytest.raises(PagedError, match="does not fit the context"):
        llm("word " * 400, max_tokens=1)
    assert llm("Hi", max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2


def test_invalid_sampling_is_rejected(llm):
    with pytest.raises(PagedError, match="top_p"):
        llm("Hi", top_p=0)


def test_closed_model_raises():
    m = Llama(n_ctx=64, n_threads=1)
    m.close()
    with pytest.raises(PagedError, match="closed"):
        m("Hi", max_tokens=1)


def test_stop_matcher_holds_back_partial_matches():
    s = StopMatcher(["STOP"])
    assert s.feed("abc ST") == ("abc ", False)
    assert s.feed("OP tail") == ("", True)
    s = StopMatcher(["xy"])
    assert s.feed("ax") == ("a", False)
    assert s.feed("b") == ("xb", False)
