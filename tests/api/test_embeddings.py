"""Embeddings through the engine (issue 15, item 1), without the real MiniLM package:
a tiny random BERT in Hugging Face's layout converted by our tool and run by the GGML
encoder graph, against the NumPy reference; decoder embeddings (pooled final hidden
states from the scheduler's prefill) against the NumPy reference model; the WordPiece
tokenizer; the Python API's shapes and errors."""

import threading

import numpy as np
import pytest

from pyllama_paged import EngineLoop, Llama, PagedError, SamplingParams
from pyllama_paged.engine import EmbedParams, Model
from pyllama_paged.convert.bert_gguf import gguf_tensor_name, llama_cpp_token
from pyllama_paged.engine.pooling.encoder import pack
from pyllama_paged.tokenizer.tokenizer import Tokenizer
from pyllama_paged.tokenizer.wordpiece import split_words
from pyllama_paged.testing.reference.bert_reference import bert_embedding
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_bert import converted, tiny_vocab
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model

TEXTS = ["the cat sat on the mat.", "Hello, World!", "dogs running fast; the river's light at night",
         "xyz qqq unknown", "red", "the big old house, the small new tree and the dark water " * 3]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return converted(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def bert(tiny_bert):
    with Llama(tiny_bert[2]["f32"], n_threads=2) as llm:
        yield llm


def reference(tiny_bert, llm, texts, pooling="mean"):
    weights, config, _ = tiny_bert
    return np.array([bert_embedding(weights, config, llm.tokenize(t), pooling) for t in texts])


# ---- the converter --------------------------------------------------------------
def test_converter_uses_llama_cpp_names_and_keys(tiny_bert):
    assert gguf_tensor_name("encoder.layer.3.attention.self.query.weight") == "blk.3.attn_q.weight"
    assert gguf_tensor_name("bert.encoder.layer.0.output.LayerNorm.bias") == "blk.0.layer_output_norm.bias"
    assert gguf_tensor_name("embeddings.position_ids") is None and gguf_tensor_name("pooler.dense.weight") is None
    assert [llama_cpp_token(t) for t in ("[CLS]", "##ing", "cat")] == ["[CLS]", "ing", "\u2581cat"]
    model = Model(tiny_bert[2]["f16"])
    try:
        meta, cfg = model.metadata, model.config
        assert meta["general.architecture"] == "bert" and meta["tokenizer.ggml.model"] == "bert"
        assert meta["bert.pooling_type"] == 1 and meta["bert.attention.causal"] is False
        assert cfg.is_encoder and cfg.pooling == "mean" and cfg.n_ctx_train == 64 and cfg.n_embd == 64
        assert meta["tokenizer.ggml.bos_token_id"] == tiny_vocab().index("[CLS]")
        assert meta["tokenizer.ggml.seperator_token_id"] == tiny_vocab().index("[SEP]")
        types = {t.name: t.type for t in model.gguf.tensors}
        assert types["blk.0.attn_q.weight"] == 1 and types["blk.0.attn_q.bias"] == 0   # f16 matrices, f32 rest
    finally:
        model.close()


# ---- the encoder graph against the NumPy reference --------------------------------
@pytest.mark.parametrize("dtype,tolerance", [("f32", 1e-5), ("f16", 2e-3)])
def test_bert_matches_reference(tiny_bert, dtype, tolerance):
    with Llama(tiny_bert[2][dtype], n_threads=2) as llm:
        got = np.array(llm.embed(TEXTS))
        want = reference(tiny_bert, llm, TEXTS)
    cos = (got * want).sum(1)
    assert np.all(1 - cos < tolerance), cos
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_bert_cls_pooling_and_raw_vectors(tiny_bert, bert):
    weights, config, _ = tiny_bert
    got = np.array(bert.embed(TEXTS[:3], pooling="cls", normalize=False))
    want = np.array([bert_embedding(weights, config, bert.tokenize(t), "cls", normalize=False) for t in TEXTS[:3]])
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_batching_does_not_change_vectors(bert):
    """Many inputs of mixed lengths in padded graphs equal each input alone."""
    texts = [" ".join(["the cat", "sat on", "the mat"][: 1 + i % 3]) * (1 + i % 5) for i in range(40)]
    together = np.array(bert.embed(texts))
    alone = np.array([bert.embed(t) for t in texts[:8]])
    assert np.abs(together[:8] - alone).max() < 1e-5


def test_pack_bounds_padding():
    lengths = [5, 60, 7, 6, 64, 3]
    batches = pack(lengths, 128)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 128


def test_many_requests_at_once_through_the_loop(tiny_bert, bert):
    """Requests from several threads share the encoder's steps; each gets its own vector."""
    from pyllama_paged.engine.pooling.encoder import encoder_engine
    model = Model(tiny_bert[2]["f32"])
    runner, engine = encoder_engine(model, 2)
    loop = EngineLoop(engine)
    try:
        results = {}

        def worker(k):
            ids = bert.tokenize(TEXTS[k % len(TEXTS)])
            for out in loop.submit(ids, EmbedParams("mean")):
                results[k] = out.embedding

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        raw = np.array(bert.embed(TEXTS, normalize=False))
        for k, vec in results.items():
            assert np.abs(vec - raw[k % len(TEXTS)]).max() < 1e-4
        assert len(results) == 12 and engine.stats()["waiting_requests"] == 0
    finally:
        loop.stop()
        runner.close()
        model.close()


# ---- WordPiece -----------------------------------------------------------------------
def test_wordpiece_words_and_pieces(bert):
    assert split_words("Héllo,World!  it's\tCAFÉ 東京") == ["hello", ",", "world", "!", "it", "'", "s", "cafe", "東", "京"]
    vocab = tiny_vocab()
    ids = bert.tokenize("Dogs running")
    assert [vocab[i] for i in ids] == ["[CLS]", "dog", "##s", "run", "##n", "##ing", "[SEP]"]
    assert [vocab[i] for i in bert.tokenize("a" * 101, add_bos=False)] == ["[UNK]"]
    assert [vocab[i] for i in bert.tokenize("é e€ ?", add_bos=False)] == ["e", "[UNK]", "?"]
    assert bert.detokenize(bert.tokenize("the dogs ran, fast")) == b"the dogs ran , fast"


def test_wordpiece_reads_both_vocabulary_spellings():
    vocab = tiny_vocab()
    hf = Tokenizer(vocab, model="bert", bos_id=vocab.index("[CLS]"), eos_id=vocab.index("[SEP]"),
                   unk_id=vocab.index("[UNK]"))
    cpp = Tokenizer([llama_cpp_token(t) for t in vocab], model="bert", bos_id=vocab.index("[CLS]"),
                    eos_id=vocab.index("[SEP]"), unk_id=vocab.index("[UNK]"))
    for text in TEXTS:
        assert hf.encode(text) == cpp.encode(text)


# ---- decoder models: pooled final hidden states ------------------------------------
@pytest.fixture(scope="module")
def tiny_decoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dec")
    return {arch: write_tiny_model(root / f"{arch}.gguf", arch, weight_type="f16") for arch in ("llama", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_decoder_embedding_matches_reference(tiny_decoders, arch, pooling):
    ref = ReferenceModel.from_gguf(tiny_decoders[arch])
    prompts = [[int(x) for x in np.random.default_rng(i).integers(4, 200, size=n)] for i, n in enumerate((5, 40, 23))]
    with Llama(tiny_decoders[arch], n_threads=2, n_ctx=128, n_batch=16) as llm:   # 40 tokens: chunked prefill
        got = [np.array(v) for v in _embed_ids(llm, prompts, pooling)]
        assert llm.stats()["blocks_used"] == 0   # no KV kept afterwards
    for ids, vec in zip(prompts, got):
        ref.forward(ids)
        h = ref.last_hidden
        want = {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[pooling]
        want = want / np.linalg.norm(want)
        assert float(vec @ want) > 0.999


def _embed_ids(llm, prompts, pooling):
    from pyllama_paged.calls.embeddings import finish_vector
    from pyllama_paged.calls.embeddings import run_embeddings
    from pyllama_paged.engine import SharedSteps
    return [finish_vector(v) for v in run_embeddings(SharedSteps(llm.llm_engine), prompts, EmbedParams(pooling))]


def test_decoder_embeddings_beside_generation_and_prefix_cache(tiny_decoders):
    """An embedding sharing a prompt with a cached generation still computes every token, and
    embeddings scheduled in the same steps as a generation leave its text unchanged."""
    with Llama(tiny_decoders["llama"], n_threads=2, n_ctx=256, n_batch=64, block_size=16) as llm:
        prompt = "the " * 40
        alone = llm(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
        # the prompt's full blocks are now in the prefix cache (pooled: the file names no pooling)
        first = np.array(llm.embed(prompt, pooling="mean"))
        again = np.array(llm.embed(prompt, pooling="mean"))
        assert float(first @ again) > 0.99999
        requests = [llm.llm_engine.add_request(llm.tokenize(prompt), SamplingParams(max_tokens=6, temperature=0.0))]
        requests += [llm.llm_engine.add_request(llm.tokenize(t), EmbedParams("mean")) for t in ("a b c", prompt)]
        text, vectors = [], {}
        while llm.llm_engine.has_work():
            for out in llm.llm_engine.step():
                text += [e.token_id for e in out.events]
                if out.embedding is not None:
                    vectors[out.request_id] = out.embedding
        assert llm.detokenize(text).decode() == alone
        mixed = vectors[requests[2].request_id]
        assert float(mixed @ first) / np.linalg.norm(mixed) > 0.99999
        assert llm.stats()["blocks_used"] == 0


# ---- the Python API -------------------------------------------------------------------
def test_llama_embedding_shapes(bert):
    one = bert.embed("the cat")
    assert isinstance(one, list) and isinstance(one[0], float) and len(one) == 64
    many = bert.embed(["the cat", "a dog"])
    assert len(many) == 2 and len(many[1]) == 64
    vectors, count = bert.embed(["the cat"], return_count=True)
    assert count == len(bert.tokenize("the cat"))
    short = bert.embed("the cat", dimensions=8)
    assert len(short) == 8 and abs(np.linalg.norm(short) - 1) < 1e-5
    r = bert.create_embedding(["the cat", "a dog"], model="m")
    assert r["object"] == "list" and r["model"] == "m" and [d["index"] for d in r["data"]] == [0, 1]
    assert r["data"][0]["object"] == "embedding" and r["data"][0]["embedding"] == pytest.approx(vectors[0], abs=1e-6)
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0


def test_bad_embedding_input_fails_clearly(bert):
    with pytest.raises(PagedError, match="no input"):
        bert.embed([])
    with pytest.raises(ValueError, match="input 1 is .* tokens; the model takes at most 64"):
        bert.embed(["ok", "the " * 100], truncate=False)
    assert len(bert.embed("the " * 100)) == 64   # truncated by default, as llama-cpp-python does
    with pytest.raises(PagedError, match="dimensions 65"):
        bert.embed("x", dimensions=65)
    with pytest.raises(PagedError, match="pooling 'max'"):
        bert.embed("x", pooling="max")
    with pytest.raises(PagedError, match="embedding model: it cannot generate"):
        bert("the cat", max_tokens=4)
    assert bert.llm_engine.stats()["waiting_requests"] == 0
