"""Reranking through the Python API and the engine: a tiny random cross-encoder (a
BertForSequenceClassification checkpoint converted by our tool) against the NumPy reference;
tiny random decoder rerankers (Qwen3-Reranker style, llama.cpp's layout) against the float64
reference model and the engine's own full logits; batching, ordering, top_n,
return_documents, truncation and the refusals.

Tolerances: cross-encoder logits (|logit| ~ 4) within 5e-3 of the float64 reference for f32
weights (GGML's GELU is a float16 table) and 5e-2 for f16; decoder P(yes) within 2e-3 of the
reference (f32 weights, f16 KV cache) and 1e-3 of the engine's own logits."""

import numpy as np
import pytest

from pyllama_paged import Llama
from pyllama_paged.errors import RequestError
from pyllama_paged.calls.embeddings import InputTooLong
from pyllama_paged.calls.rerank import RerankRequestError, prepare_rerank
from pyllama_paged.calls.rerank_inputs import QWEN3_TEMPLATE, PairEncoder
from pyllama_paged.convert.bert_gguf import convert, head_tensor_name
from pyllama_paged.engine import EmbedParams, Model
from pyllama_paged.engine.prompt_logprobs import prompt_logprobs
from pyllama_paged.calls.rerank_head import NotAReranker
from pyllama_paged.testing.reference.bert_reference import cross_encoder_logits
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_bert import converted, write_tiny_bert, write_tiny_cross_encoder
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_reranker import reference_score, write_tiny_decoder_reranker

QUERY = "the cat on the mat"
DOCS = ["the cat sat on the mat.", "hello world", "dogs running fast at night", "red blue green water",
        "the small cat and the big dog", "night day light dark"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return converted(tmp_path_factory.mktemp("ce"), write_tiny_cross_encoder, "ce")


@pytest.fixture(scope="module")
def ce(cross_encoder):
    with Llama(cross_encoder[2]["f32"], n_threads=2) as llm:
        yield llm


def pair_reference(cross_encoder, llm, query, doc):
    """The reference logit of one pair, from the tokenizer's own ids and BERT's segments."""
    tok = llm._tokenizer
    head = tok.encode(query)
    body = tok.encode(doc, add_special=False) + [tok.eos_id]
    return float(cross_encoder_logits(*cross_encoder[:2], head + body, [0] * len(head) + [1] * len(body))[0])


def scores_by_index(response) -> dict[int, float]:
    return {r["index"]: r["relevance_score"] for r in response["results"]}


# ---- the converter ----------------------------------------------------------------
def test_converter_writes_llama_cpp_rank_head(cross_encoder):
    assert head_tensor_name("bert.pooler.dense.weight") == "cls.weight"
    assert head_tensor_name("classifier.bias") == "cls.output.bias" and head_tensor_name("bert.embeddings.x") is None
    model = Model(cross_encoder[2]["f16"])
    try:
        meta = model.metadata
        assert meta["bert.pooling_type"] == 4 and model.config.pooling == "rank"
        assert meta["bert.classifier.output_labels"] == ["LABEL_0"]
        shapes = {t.name: t.shape for t in model.gguf.tensors}
        assert shapes["cls.weight"] == (64, 64) and shapes["cls.bias"] == (64,)
        assert shapes["cls.output.weight"] == (64, 1) and shapes["cls.output.bias"] == (1,)
    finally:
        model.close()


# ---- cross-encoder scores against the NumPy reference --------------------------------
@pytest.mark.parametrize("dtype,tolerance", [("f32", 5e-3), ("f16", 5e-2)])
def test_cross_encoder_matches_reference(cross_encoder, dtype, tolerance):
    with Llama(cross_encoder[2][dtype], n_threads=2) as llm:
        got = scores_by_index(llm.rerank(QUERY, DOCS))
        want = [pair_reference(cross_encoder, llm, QUERY, d) for d in DOCS]
    assert sorted(got) == list(range(len(DOCS)))
    assert max(abs(got[i] - want[i]) for i in range(len(DOCS))) < tolerance, (got, want)


def test_cross_encoder_reads_the_document_as_segment_one(cross_encoder, ce):
    """The scores follow BERT's sentence pairs (document tokens of type 1): the same ids all of
    type 0 would score measurably differently."""
    got = scores_by_index(ce.rerank(QUERY, DOCS[:2]))
    tok = ce._tokenizer
    ids = tok.encode(QUERY) + tok.encode(DOCS[0], add_special=False) + [tok.eos_id]
    flat = float(cross_encoder_logits(*cross_encoder[:2], ids, [0] * len(ids))[0])
    assert abs(got[0] - pair_reference(cross_encoder, ce, QUERY, DOCS[0])) < 5e-3
    assert abs(got[0] - flat) > 5e-2


def test_all_documents_run_as_one_encoder_step(ce):
    before = ce.stats()["steps"]
    response = ce.rerank(QUERY, DOCS * 4)
    assert ce.stats()["steps"] == before + 1 and len(response["results"]) == 4 * len(DOCS)
    alone = scores_by_index(ce.rerank(QUERY, DOCS[3:4]))[0]
    assert abs(scores_by_index(response)[3] - alone) < 1e-4   # padding in a batch changes nothing


def test_order_top_n_documents_and_usage(ce):
    full = ce.rerank(QUERY, DOCS)
    scores = [r["relevance_score"] for r in full["results"]]
    assert scores == sorted(scores, reverse=True) and "document" not in full["results"][0]
    assert full["object"] == "list" and full["usage"]["prompt_tokens"] == full["usage"]["total_tokens"] > len(DOCS)
    top = ce.rerank(QUERY, [{"text": d} for d in DOCS], top_n=2, return_documents=True)
    assert top["results"] == [{**r, "document": {"text": DOCS[r["index"]]}} for r in full["results"][:2]]
    assert len(ce.rerank(QUERY, DOCS, top_n=100)["results"]) == len(DOCS)
    same = ce.rerank(QUERY, [DOCS[1], DOCS[1], DOCS[1]])   # equal scores keep the documents' order
    assert [r["index"] for r in same["results"]] == [0, 1, 2]


def test_request_errors(ce):
    for query, docs, top_n, param in (("", DOCS, None, "query"), (QUERY, [], None, "documents"),
                                      (QUERY, DOCS, 0, "top_n"), (QUERY, DOCS, True, "top_n"),
                                      (QUERY, [{"txt": "x"}], None, "documents")):
        with pytest.raises(RerankRequestError) as e:
            ce.rerank(query, docs, top_n=top_n)
        assert e.value.param == param


def test_over_long_pair_is_refused_or_truncated(cross_encoder, ce):
    long_doc = "the cat sat on the mat " * 20   # past the tiny model's 64 positions
    with pytest.raises(InputTooLong, match="document 1: .* at most 64"):
        ce.rerank(QUERY, [DOCS[0], long_doc])
    cut = scores_by_index(ce.rerank(QUERY, [DOCS[0], long_doc], truncate=True))
    tok = ce._tokenizer
    head = tok.encode(QUERY)
    body = tok.encode(long_doc, add_special=False)[:64 - len(head) - 1] + [tok.eos_id]
    want = float(cross_encoder_logits(*cross_encoder[:2], head + body, [0] * len(head) + [1] * len(body))[0])
    assert abs(cut[1] - want) < 5e-3
    with pytest.raises(InputTooLong, match="query alone"):
        ce.rerank("cat " * 70, DOCS[:1], truncate=True)


def test_engines_check_token_types(ce, decoders):
    ids = ce.tokenize("the cat")
    assert "token types for" in ce.llm_engine.add_request(ids, EmbedParams("cls", (0,) * (len(ids) - 1))).error
    assert "below 2" in ce.llm_engine.add_request(ids, EmbedParams("cls", (2,) * len(ids))).error
    with Llama(decoders["plain"], n_threads=2) as llm:
        with pytest.raises(RequestError, match="encoder models"):
            llm.llm_engine.add_request(ids, EmbedParams("last", (0,) * len(ids)))


def test_embedding_model_without_head_is_not_a_reranker(tmp_path):
    write_tiny_bert(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "emb.gguf", "f32")
    with Llama(str(path), n_threads=2) as llm:
        with pytest.raises(NotAReranker, match="without a classification head"):
            llm.rerank(QUERY, DOCS)


# ---- decoder rerankers ----------------------------------------------------------------
@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dec")
    return {"cls_output": write_tiny_decoder_reranker(root / "qwen3.gguf", "qwen3", "cls_output", weight_type="f32"),
            "tokens": write_tiny_decoder_reranker(root / "gemma3.gguf", "gemma3", "tokens", weight_type="f32",
                                                  final_logit_softcapping=5.0),
            "plain": write_tiny_model(root / "plain.gguf", "llama", weight_type="f32", extra_pieces=("yes", "no"))}


DEC_QUERY = "the capital of France"
DEC_DOCS = ["The capital of France is Paris", "hello world", "a and the", "Paris is the capital"]


@pytest.mark.parametrize("head", ["cls_output", "tokens"])
def test_decoder_reranker_matches_reference(decoders, head):
    ref = ReferenceModel.from_gguf(decoders[head])
    with Llama(decoders[head], n_threads=2, n_ctx=512, n_batch=64) as llm:   # chunked prefill
        response = llm.rerank(DEC_QUERY, DEC_DOCS)
        job = prepare_rerank(llm._model, llm._tokenizer, llm.chat_template, 511, "tiny", DEC_QUERY, DEC_DOCS, False)
        assert llm.stats()["blocks_used"] == 0
    got = scores_by_index(response)
    want = [reference_score(ref, ids) for ids in job.inputs]
    assert all(0 < got[i] < 1 for i in got)
    assert max(abs(got[i] - want[i]) for i in range(len(DEC_DOCS))) < 2e-3, (got, want)


def test_decoder_yes_no_score_agrees_with_the_engines_own_logits(decoders):
    with Llama(decoders["tokens"], n_threads=2, n_ctx=512) as llm:
        got = scores_by_index(llm.rerank(DEC_QUERY, DEC_DOCS))
        job = prepare_rerank(llm._model, llm._tokenizer, llm.chat_template, 511, "tiny", DEC_QUERY, DEC_DOCS, False)
        yes, no = (llm._tokenizer.token_to_id(w) for w in ("yes", "no"))
        steps = llm._shared_steps()
        for i, ids in enumerate(job.inputs):
            lp_yes, lp_no = (steps.call(lambda e, t=t: prompt_logprobs(e.runner, ids + [t]))[-1][0] for t in (yes, no))
            assert abs(got[i] - 1 / (1 + np.exp(lp_no - lp_yes))) < 1e-3


def test_decoder_prompts(decoders):
    """The GGUF's rerank template first, then Qwen3-Reranker's prompt for a ChatML vocabulary,
    else the chat template; a document's control-token text stays text."""
    model = Model(decoders["cls_output"])
    try:
        from pyllama_paged.tokenizer.tokenizer import Tokenizer
        tok = Tokenizer.from_metadata(model.metadata)
        enc = PairEncoder(tok, False, 1, model.metadata, None, 256)
        assert str(enc.render("q {document}", "<s> d")) == "<Query>: q {document}\n<Document>: <s> d\nRelevant:"
        ids = enc.encode("q", ["<s>"], False)[0][0]
        assert ids.count(tok.bos_id) == 1   # only the one the tokenizer adds
        assert "{query}" in QWEN3_TEMPLATE and "<think>" in QWEN3_TEMPLATE
    finally:
        model.close()


def test_decoder_truncation(decoders):
    with Llama(decoders["cls_output"], n_threads=2, n_ctx=64) as llm:
        long_doc = "Paris " * 80
        with pytest.raises(InputTooLong, match="document 0"):
            llm.rerank(DEC_QUERY, [long_doc])
        job = prepare_rerank(llm._model, llm._tokenizer, llm.chat_template, 63, "tiny", DEC_QUERY, [long_doc], True)
        assert 50 < len(job.inputs[0]) <= 63
        assert len(llm.rerank(DEC_QUERY, [long_doc, "hello"], truncate=True)["results"]) == 2


def test_plain_decoder_is_refused_unless_loaded_as_rank(decoders):
    with Llama(decoders["plain"], n_threads=2, n_ctx=512) as llm:
        with pytest.raises(NotAReranker, match="not a reranker.*pooling_type 4"):
            llm.rerank(DEC_QUERY, DEC_DOCS)
    ref = ReferenceModel.from_gguf(decoders["plain"])
    with Llama(decoders["plain"], n_threads=2, n_ctx=512, pooling_type=4) as llm:   # llama.cpp's RANK
        got = scores_by_index(llm.rerank(DEC_QUERY, DEC_DOCS[:2]))
        job = prepare_rerank(llm._model, llm._tokenizer, llm.chat_template, 511, "t", DEC_QUERY, DEC_DOCS[:2], False,
                             force=True)
    assert max(abs(got[i] - reference_score(ref, ids)) for i, ids in enumerate(job.inputs)) < 2e-3
