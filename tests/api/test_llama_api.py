"""The llama-cpp-python-shaped API on the default model: completions, streaming,
stop strings, seeds, logprobs, echo, errors."""

import numpy as np
import pytest

from pyllama_paged.errors import PagedError
from pyllama_paged.api.llama import Llama
from pyllama_paged.calls.text_stream import StopMatcher


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
    assert s.matched == "STOP"   # which stop cut the text (Anthropic's stop_sequence names it)
    s = StopMatcher(["xy"])
    assert s.feed("ax") == ("a", False)
    assert s.feed("b") == ("xb", False)
    assert s.matched is None
    s = StopMatcher(["b", "ab"])   # completing at the same character, the longest wins
    assert s.feed("xab") == ("x", True) and s.matched == "ab"


# ---- llama-cpp-python's arguments, hooks and state (issue 15, item 2) ------------
def test_positional_order_is_llama_cpp_pythons(llm):
    # create_completion(prompt, suffix, max_tokens, temperature, ...); detokenize(tokens, prev_tokens)
    out = llm.create_completion("The capital of France is", None, 3, 0.0)
    assert out["usage"]["completion_tokens"] == 3
    with pytest.raises(ValueError, match="suffix"):
        llm("def f(", "return 1")
    ids = llm.tokenize(b"Hello world")
    assert llm.detokenize(ids[2:], ids[:2]) == llm.detokenize(ids[2:])


def test_request_errors_are_value_errors(llm):
    from pyllama_paged import RequestError

    for call in (lambda: llm("word " * 400, max_tokens=1), lambda: llm("Hi", top_p=0),
                 lambda: llm("Hi", logit_bias={10**9: 1.0}), lambda: llm("Hi", grammar="root ::= (")):
        with pytest.raises(ValueError) as e:
            call()
        assert isinstance(e.value, RequestError) and isinstance(e.value, PagedError)


def test_logit_bias_forces_and_bans_tokens(llm):
    greedy = llm("The capital of France is", max_tokens=4, temperature=0)["choices"][0]["text"]
    paris = llm.tokenize(b" Paris", add_bos=False)
    assert len(paris) == 1
    forced = llm("The capital of France is", max_tokens=3, temperature=0, logit_bias={paris[0]: 100})
    assert forced["choices"][0]["text"] == " Paris" * 3
    first = llm.tokenize(greedy.encode(), add_bos=False)[0]
    banned = llm("The capital of France is", max_tokens=4, temperature=0, logit_bias={str(first): -100})
    assert llm.tokenize(banned["choices"][0]["text"].encode(), add_bos=False)[0] != first


def test_logits_processor_and_stopping_criteria(llm):
    from pyllama_paged import LogitsProcessorList, MinTokensLogitsProcessor, StoppingCriteriaList

    prompt = llm.tokenize(b"The capital of France is")
    seen = []

    def record(input_ids, scores):
        seen.append((input_ids.copy(), scores.shape))
        return scores

    out = llm("The capital of France is", max_tokens=5, temperature=0, logits_processor=LogitsProcessorList([record]))
    assert [len(ids) for ids, _ in seen] == [len(prompt) + k for k in range(5)]
    assert list(seen[0][0]) == prompt and seen[0][1] == (llm.n_vocab(),)
    # the criterion sees the ids before each draw; when it says stop, that draw is dropped
    stop_after = StoppingCriteriaList([lambda ids, logits: len(ids) >= len(prompt) + 2])
    cut = llm("The capital of France is", max_tokens=8, temperature=0, stopping_criteria=stop_after)
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == 2
    assert out["choices"][0]["text"].startswith(cut["choices"][0]["text"])
    # end-of-text forbidden for 12 tokens: the answer cannot end sooner
    messages = [{"role": "user", "content": "Say OK."}]
    min_tokens = LogitsProcessorList([MinTokensLogitsProcessor(12, llm.token_eos())])
    for eos in sorted(llm._tokenizer.eot_ids):
        min_tokens.append(MinTokensLogitsProcessor(12, eos))
    r = llm.create_chat_completion(messages, max_tokens=12, temperature=0, logits_processor=min_tokens)
    assert r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == "length"


def test_generate_yields_ids_and_state_round_trips(llm):
    import itertools

    tokens = llm.tokenize(b"Once upon a time")
    first = list(itertools.islice(llm.generate(tokens, temp=0), 4))
    assert all(isinstance(t, int) for t in first)
    assert llm.n_tokens == len(tokens) + 4 and llm.stats()["blocks_used"] == 0   # stopping freed the pages
    state = llm.save_state()
    assert list(state.input_ids) == tokens + first and state.n_tokens == len(tokens) + 4
    nxt = list(itertools.islice(llm.generate([], reset=False, temp=0), 3))
    llm.reset()
    assert llm.n_tokens == 0
    llm.load_state(state)
    assert list(itertools.islice(llm.generate([], reset=False, temp=0), 3)) == nxt
    # continuing is the same as giving the whole prompt again
    assert list(itertools.islice(llm.generate(tokens + first, temp=0), 3)) == nxt


def test_chat_defaults_stream_end_and_logprobs(llm):
    import inspect

    assert inspect.signature(llm.create_chat_completion).parameters["temperature"].default == 0.2
    assert inspect.signature(llm.create_completion).parameters["temperature"].default == 0.8
    messages = [{"role": "user", "content": "Hi"}]
    chunks = list(llm.create_chat_completion(messages, max_tokens=3, stream=True, logprobs=True, top_logprobs=2))
    for chunk in chunks:   # the loop every llama-cpp-python user writes
        chunk["choices"][0]["delta"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 3
    whole = llm.create_chat_completion(messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == whole["choices"][0]["message"]["content"]
    v1 = llm.create_chat_completion_openai_v1(messages, max_tokens=2)
    assert v1.choices[0].message.role == "assistant"


def test_constructor_accepts_llama_cpp_arguments_and_warns_once():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = Llama(n_ctx=0, n_threads=2, n_gpu_layers=-1, use_mmap=True, flash_attn=True, rope_freq_base=0.0,
                  type_k=8, type_v=8, seed=0xFFFFFFFF, embedding=False, logits_all=True, n_ubatch=64,
                  not_an_argument=3, verbose=False)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 3 and sum("n_gpu_layers" in t for t in texts) == 1   # use_mmap/flash_attn: neutral
    assert any("not_an_argument" in t for t in texts) and any("n_ubatch" in t for t in texts)
    assert m.n_ctx() == m._model.config.n_ctx_train and m.runner.kv_cache_type == "q8_0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m("Hi", max_tokens=1, typical_p=0.5)
        m("Hi", max_tokens=1, typical_p=0.5)
    assert len(caught) == 1 and "typical_p" in str(caught[0].message)
    m.close()
    with pytest.raises(ValueError, match="K and V"):
        Llama(n_ctx=64, type_k=1, type_v=8)
    with pytest.raises(ValueError, match="BF16"):
        Llama(n_ctx=64, type_k=30, type_v=30)
    with pytest.raises(ValueError, match="adapter.gguf: no such file"):
        Llama(n_ctx=64, lora_path="adapter.gguf")


def test_panel_gemm_can_be_turned_off():
    """pack_panels=False keeps GGML's kernels; both answer the same greedy continuation's first token."""
    with Llama(n_ctx=128, n_threads=2, pack_panels=False) as plain:
        assert plain._model.panel_kernel == "ggml" and plain._model.n_panel_packed == 0
        want = plain("The capital of France is", max_tokens=1, temperature=0)["choices"][0]["text"]
    with Llama(n_ctx=128, n_threads=2) as packed:
        assert packed("The capital of France is", max_tokens=1, temperature=0)["choices"][0]["text"] == want


def test_llama_grammar(llm, tmp_path):
    import json

    from pyllama_paged import LlamaGrammar

    yes_no = LlamaGrammar.from_string('root ::= "yes" | "no"')
    assert llm("Is the sky blue?", grammar=yes_no, max_tokens=-1)["choices"][0]["text"] in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    # greedy and room to close: a sampled run may spend its tokens on the whitespace the grammar allows
    out = llm("A number:", grammar=LlamaGrammar.from_json_schema(json.dumps(schema)), max_tokens=64, temperature=0)
    assert isinstance(json.loads(out["choices"][0]["text"])["n"], int)
    path = tmp_path / "digits.gbnf"
    path.write_text('root ::= [0-9]{3}')
    assert LlamaGrammar.from_file(path).grammar == 'root ::= [0-9]{3}'
    with pytest.raises(ValueError, match="does not parse"):
        LlamaGrammar.from_string("root ::= (")
    with pytest.raises(ValueError, match="not valid JSON"):
        LlamaGrammar.from_json_schema("{")


def test_from_pretrained_local_directory_and_hf_cache(tmp_path, monkeypatch):
    from pyllama_paged.engine import default_model_path
    from pyllama_paged.testing.model_sources import ModelSources

    src = default_model_path()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-Q4_K_M.gguf").symlink_to(src)
    m = Llama.from_pretrained(str(tmp_path / "models"), "*q4_k_m.gguf", n_ctx=64)
    assert m.model_path.endswith("tiny-Q4_K_M.gguf")
    m.close()
    snapshot = tmp_path / "hub" / "models--someone--tiny-GGUF" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.Q4_K_M.gguf").symlink_to(src)
    m = Llama.from_pretrained("someone/tiny-GGUF", "*Q4_K_M.gguf", cache_dir=tmp_path / "hub", n_ctx=64)
    m.close()
    (snapshot / "tiny.Q8_0.gguf").symlink_to(src)
    with pytest.raises(ValueError, match="several files"):
        Llama.from_pretrained("someone/tiny-GGUF", "*.gguf", cache_dir=tmp_path / "hub")
    with ModelSources() as hub_without_it, pytest.raises(ValueError, match="no local file matches .* not found"):
        # found nowhere here, it is asked of the Hub (a local one: tests/api/test_pretrained_download.py)
        monkeypatch.setenv("HF_ENDPOINT", hub_without_it.url)
        Llama.from_pretrained("someone/other-GGUF", "*.gguf", cache_dir=tmp_path / "hub")


def test_lora_path_and_scale(tmp_path):
    """Llama(lora_path=, lora_scale=) as llama-cpp-python: every call runs the adapter at that
    scale (the float64 reference W + scale * alpha / rank * B A); a wrong file is refused."""
    from pyllama_paged.testing.reference.numpy_model import ReferenceModel
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    from pyllama_paged.testing.reference.tiny_lora import with_lora, write_tiny_lora

    base = write_tiny_model(tmp_path / "base.gguf", "llama", weight_type="q8_0")
    adapter = write_tiny_lora(tmp_path / "adapter.gguf", base, seed=3)
    prompt = [2, 17, 99, 42, 7, 150, 33, 61]
    ref = ReferenceModel.from_gguf(base)
    want = with_lora(ref, adapter, 0.5).forward(prompt)[-1]
    with Llama(base, n_ctx=64, n_threads=2, lora_path=adapter, lora_scale=0.5, verbose=False) as llm:
        llm.eval(prompt)
        got = np.asarray(llm.eval_logits[0])
    assert np.abs(got - want).max() / np.ptp(want) < 3e-2
    assert np.abs(ref.forward(prompt)[-1] - want).max() / np.ptp(want) > 0.2   # the adapter changed them
    with pytest.raises(ValueError, match="not an adapter file"):
        Llama(base, n_ctx=64, lora_path=base, verbose=False)
