"""llama-cpp-python's snippets that a new user's first hour met failing (issue 40), run with
only the import changed, on the embedded default model: prompt-lookup speculative decoding
(LlamaPromptLookupDecoding), the low-level eval/sample token loop, per-token embeddings of a
model that does not pool; and the parts we do not provide (the Llava chat handler, the
low-level ctypes API) refused with an error that says what to use instead."""

import importlib

import numpy as np
import pytest

import pyllama_paged
from pyllama_paged import Llama, LlamaGrammar
from pyllama_paged.engine import default_model_path

MODEL_PATH = default_model_path()


@pytest.fixture(scope="module")
def llm():
    with Llama(model_path=MODEL_PATH, n_ctx=256, n_threads=2) as model:
        yield model


# ---- speculative decoding: llama-cpp-python's README snippet ------------------------
def test_prompt_lookup_decoding_snippet_speculates():
    from pyllama_paged.llama_speculative import LlamaPromptLookupDecoding  # was: llama_cpp.llama_speculative

    llama = Llama(
        model_path=MODEL_PATH,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2)  # 2 performs better for cpu-only machines
    )
    try:
        speculator = llama.llm_engine.speculator
        assert speculator is not None and speculator.config.method == "prompt_lookup"
        assert (speculator.config.num_draft_tokens, speculator.config.max_ngram) == (2, 2)
        # a prompt that repeats itself: the lookup finds what follows, and the model accepts some of it
        text = llama("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", max_tokens=24, temperature=0)
        assert text["choices"][0]["text"]
        stats = llama.stats()
        assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    finally:
        llama.close()


def test_prompt_lookup_decoding_drafts_on_its_own():
    from pyllama_paged.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=3)
    got = draft(np.array([5, 6, 7, 8, 9, 5, 6], dtype=np.intc))
    assert got.dtype == np.intc and got.tolist() == [7, 8, 9]
    assert draft(np.array([1, 2, 3], dtype=np.intc)).tolist() == []   # no earlier occurrence


def test_draft_models_we_cannot_run_are_refused_before_loading():
    from pyllama_paged.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    class MyDrafter(LlamaDraftModel):
        def __call__(self, input_ids, /, **kwargs):
            return np.array([], dtype=np.intc)

    with pytest.raises(ValueError, match="LlamaPromptLookupDecoding"):
        Llama(MODEL_PATH, draft_model=MyDrafter())
    with pytest.raises(ValueError, match="speculative=.*draft_model"):
        Llama(MODEL_PATH, draft_model="draft.gguf")
    with pytest.raises(ValueError, match="not both"):
        Llama(MODEL_PATH, draft_model=LlamaPromptLookupDecoding(), speculative=True)


# ---- the low-level loop: eval appends, sample draws ------------------------------
def test_eval_and_sample_loop(llm):
    llm.reset()
    tokens = llm.tokenize(b"Q: Name the planets in the solar system? A: ")
    llm.eval(tokens)
    assert llm.n_tokens == len(tokens) and llm.input_ids.tolist() == tokens
    drawn = []
    for _ in range(6):
        logits = np.array(llm.eval_logits[-1], dtype=np.float32)
        assert logits.shape == (llm.n_vocab(),)
        token = llm.sample(temp=0)   # greedy: the best of the logits after the evaluated tokens
        assert token == int(np.argmax(logits))
        assert llm.n_tokens == len(tokens) + len(drawn)   # sample does not append; eval does
        llm.eval([token])
        drawn.append(token)
    assert llm.input_ids.tolist() == tokens + drawn
    llm.n_tokens = len(tokens)   # their loops rewind by setting n_tokens
    assert llm.input_ids.tolist() == tokens
    assert llm.sample(temp=0) == int(np.argmax(np.array(llm.eval_logits[-1])))
    # llama-cpp-python's usual sampling arguments, as its generate loop passes them
    token = llm.sample(top_k=40, top_p=0.95, min_p=0.05, temp=0.8, repeat_penalty=1.1)
    assert 0 <= token < llm.n_vocab()
    assert llm.stats()["blocks_used"] == 0   # every evaluation's pages went back


def test_sample_applies_the_processor_then_the_penalties(llm):
    llm.reset()
    llm.eval(llm.tokenize(b"The cat sat on the"))
    favourite = llm.input_ids.tolist()[-1]   # a token already in the context

    def prefer(input_ids, scores):
        scores[favourite] = scores.max() + 5.0
        return scores

    assert llm.sample(temp=0, logits_processor=prefer) == favourite
    # a repeat penalty over the context (last_n_tokens_size) acts after the processor
    assert llm.sample(temp=0, logits_processor=prefer, repeat_penalty=1e6) != favourite
    with pytest.raises(ValueError, match="only the logits after the last"):
        llm.sample(idx=0)


def test_sample_follows_a_grammar_across_calls(llm):
    grammar = LlamaGrammar.from_string('root ::= "yes" | "no"')
    llm.reset()
    llm.eval(llm.tokenize(b"Is the sky blue? Answer:"))
    drawn = []
    for _ in range(8):
        token = llm.sample(temp=0.8, grammar=grammar)
        if token == llm.token_eos():   # the grammar allows only the end once complete
            break
        drawn.append(token)
        llm.eval([token])
    assert llm.detokenize(drawn).decode() in ("yes", "no")


def test_sample_after_a_generation_uses_its_tokens(llm):
    out = llm("Once upon a time", max_tokens=4, temperature=0)
    assert out["choices"][0]["text"]
    token = llm.sample(temp=0)   # the logits after the prompt and its answer, computed on demand
    assert token == int(np.argmax(np.array(llm.eval_logits[-1])))


# ---- embeddings: one vector per token where the model does not pool ----------------
def test_embed_gives_one_vector_per_token_without_pooling():
    llm = Llama(model_path=MODEL_PATH, embedding=True, n_threads=2)
    try:
        n = len(llm.tokenize(b"Hello, world!"))
        per_token = llm.embed("Hello, world!")
        assert len(per_token) == n and all(len(v) == llm.n_embd() for v in per_token)
        assert np.allclose(np.linalg.norm(np.array(per_token), axis=1), 1, atol=1e-5)   # each normalized
        many, count = llm.embed(["a cat", "Hello, world!"], return_count=True)
        assert [len(v) for v in many] == [len(llm.tokenize(b"a cat")), n] and count == len(many[0]) + n
        # asking for a pooling pools, as before: the mean of the token states
        raw = np.array(llm.embed("Hello, world!", normalize=False))
        mean = raw.mean(0) / np.linalg.norm(raw.mean(0))
        pooled = np.array(llm.embed("Hello, world!", pooling="mean"))
        assert pooled.shape == (llm.n_embd(),) and float(pooled @ mean) > 0.9999
        # OpenAI's shape stays one vector per input
        assert len(llm.create_embedding("Hello, world!")["data"][0]["embedding"]) == llm.n_embd()
    finally:
        llm.close()


def test_embed_pools_when_the_constructor_asks():
    with Llama(model_path=MODEL_PATH, embedding=True, pooling_type=1, n_threads=2) as llm:   # LLAMA_POOLING_TYPE_MEAN
        assert len(llm.embed("Hello, world!")) == llm.n_embd()


# ---- what we do not provide: refused with what to use instead ----------------------
def test_llava_chat_handler_is_refused_with_what_to_use():
    from pyllama_paged.llama_chat_format import Llava15ChatHandler  # was: llama_cpp.llama_chat_format

    with pytest.raises(ImportError, match="images are not supported.*chat_format") as e:
        Llava15ChatHandler(clip_model_path="path/to/llava/mmproj.bin")
    assert isinstance(e.value, pyllama_paged.PagedError)

    class TheirHandler:   # llama-cpp-python's own handler object, had it been installed beside ours
        clip_model_path = "mmproj.bin"

        def __call__(self, **kwargs):
            raise AssertionError("never called")

    with pytest.raises(ImportError, match="images are not supported"):
        Llama(model_path=MODEL_PATH, chat_handler=TheirHandler(), n_ctx=2048)


def test_low_level_api_is_refused_with_what_to_use():
    import pyllama_paged as llama_cpp  # was: import llama_cpp

    with pytest.raises(AttributeError, match="low-level ctypes API.*tokenize.*eval/sample"):
        llama_cpp.llama_backend_init()
    with pytest.raises(AttributeError, match="low-level ctypes API"):
        llama_cpp.llama_token_get_text
    assert not hasattr(llama_cpp, "llama_token_get_text") and not hasattr(llama_cpp, "no_such_name")
    with pytest.raises(ImportError, match="low-level ctypes API"):
        importlib.import_module("pyllama_paged.llama_cpp")   # was: import llama_cpp.llama_cpp
    # the submodules we do provide are there by attribute too, as llama_cpp's are
    assert llama_cpp.llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=2).num_pred_tokens == 2
