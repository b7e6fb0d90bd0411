"""Reranking over HTTP (/v1/rerank, /api/rerank and llama.cpp's aliases) against a real
server holding a tiny cross-encoder, a tiny decoder reranker, a tiny embedding BERT and a
tiny chat model: the scores the Python API gives, the answer's shape, top_n and
return_documents, litellm's Jina and vLLM rerank clients, the errors in each route's shape,
and the request metrics."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of litellm's price list

import httpx  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402

from pyllama_paged import Llama  # noqa: E402
from pyllama_paged.convert.bert_gguf import convert  # noqa: E402
from pyllama_paged.server.app import create_app  # noqa: E402
from pyllama_paged.server.generation import Limits  # noqa: E402
from pyllama_paged.server.registry import ModelRegistry  # noqa: E402
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.testing.reference.tiny_bert import write_tiny_bert, write_tiny_cross_encoder  # noqa: E402
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model  # noqa: E402
from pyllama_paged.testing.reference.tiny_reranker import write_tiny_decoder_reranker  # noqa: E402
from pyllama_paged.testing.serving import Running, wait_until  # noqa: E402

CE, DEC, EMB, CHAT = "tiny-ce", "tiny-rank", "tiny-emb", "tiny-chat"
QUERY = "the cat on the mat"
DOCS = ["the cat sat on the mat.", "hello world", "dogs running fast at night", "red blue green water"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank")
    write_tiny_cross_encoder(root / "ce")
    write_tiny_bert(root / "emb")
    return {CE: str(convert(root / "ce", root / f"{CE}.gguf", "f32")),
            EMB: str(convert(root / "emb", root / f"{EMB}.gguf", "f32")),
            DEC: write_tiny_decoder_reranker(root / f"{DEC}.gguf", "qwen3", "cls_output", weight_type="f32"),
            CHAT: write_tiny_model(root / f"{CHAT}.gguf", "gemma3")}


@pytest.fixture(scope="module")
def expected(paths):
    """Each reranker's scores by document index, as the Python API gives them."""
    out = {}
    for name in (CE, DEC):
        with Llama(paths[name], n_threads=2, n_ctx=512) as llm:
            out[name] = {r["index"]: r["relevance_score"] for r in llm.rerank(QUERY, DOCS)["results"]}
    return out


@pytest.fixture(scope="module")
def server(paths):
    registry = ModelRegistry([paths[n] for n in (CE, DEC, EMB, CHAT)],
                             ServeConfig.flat(n_ctx=512, n_threads=2, n_batch=128, kv_budget_tokens=4096))
    s = Running(create_app(registry, Limits(max_embedding_inputs=8)))
    yield s
    s.close()
    registry.close()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def check_scores(results, want, tolerance=1e-3):
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < tolerance


@pytest.mark.parametrize("name", [CE, DEC])
def test_v1_rerank_gives_the_python_api_scores(server, expected, name):
    r = post(server, "/v1/rerank", {"model": name, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == name and body["object"] == "list" and len(body["results"]) == len(DOCS)
    assert sorted(x["index"] for x in body["results"]) == list(range(len(DOCS)))
    assert "document" not in body["results"][0]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(DOCS)
    check_scores(body["results"], expected[name])


def test_top_n_return_documents_and_document_objects(server, expected):
    r = post(server, "/v1/rerank", {"model": CE, "query": QUERY, "documents": [{"text": d} for d in DOCS],
                                    "top_n": 2, "return_documents": True})
    results = r.json()["results"]
    best = sorted(expected[CE], key=lambda i: -expected[CE][i])[:2]
    assert [x["index"] for x in results] == best
    assert [x["document"] for x in results] == [{"text": DOCS[i]} for i in best]


@pytest.mark.parametrize("path", ["/api/rerank", "/rerank", "/reranking", "/v1/reranking"])
def test_aliases_answer_alike(server, expected, path):
    r = post(server, path, {"model": CE, "query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 3
    check_scores(r.json()["results"], expected[CE])


def test_litellm_clients(server, expected):
    """litellm's Jina client posts to /v1/rerank, its hosted-vLLM client to /rerank."""
    for model in (f"jina_ai/{CE}", f"hosted_vllm/{CE}"):
        r = litellm.rerank(model=model, api_base=server.url, api_key="x", query=QUERY, documents=DOCS, top_n=2)
        assert len(r.results) == 2
        check_scores(r.results, expected[CE])


def test_over_long_pair_is_a_400_unless_truncated(server):
    long_doc = "the cat sat on the mat " * 20   # past the tiny cross-encoder's 64 positions
    r = post(server, "/v1/rerank", {"model": CE, "query": QUERY, "documents": [DOCS[0], long_doc]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert "document 1" in r.json()["error"]["message"] and "at most 64" in r.json()["error"]["message"]
    r = post(server, "/v1/rerank", {"model": CE, "query": QUERY, "documents": [DOCS[0], long_doc], "truncate": True})
    assert r.status_code == 200 and len(r.json()["results"]) == 2


@pytest.mark.parametrize("body,param,words", [
    ({"model": CHAT, "query": QUERY, "documents": DOCS}, "model", "not a reranker"),
    ({"model": EMB, "query": QUERY, "documents": DOCS}, "model", "without a classification head"),
    ({"model": CE, "query": QUERY, "documents": []}, "documents", "documents is empty"),
    ({"model": CE, "query": "", "documents": DOCS}, "query", "query is empty"),
    ({"model": CE, "query": QUERY, "documents": DOCS, "top_n": 0}, "top_n", "positive integer"),
    ({"model": CE, "query": QUERY, "documents": DOCS * 3}, "documents", "limit is 8"),
    ({"model": CE, "documents": DOCS}, "query", "Field required"),
    ({"model": CE, "query": QUERY, "documents": [1, 2]}, "documents.0", ""),
    ({"model": CE, "query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n", ""),
])
def test_errors_in_openai_shape(server, body, param, words):
    r = post(server, "/v1/rerank", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param) and words in error["message"]


def test_unknown_model_and_malformed_body_in_each_shape(server):
    r = post(server, "/v1/rerank", {"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(server, "/api/rerank", {"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and "'nope' not found" in r.json()["error"]
    r = post(server, "/api/rerank", {"model": CHAT, "query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]
    for path in ("/v1/rerank", "/api/rerank"):
        r = httpx.post(server.url + path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in str(r.json()["error"])


def test_metrics_count_rerank_requests_and_pages_are_freed(server):
    before = server.app.state.pp.metrics.prompt_tokens
    assert post(server, "/v1/rerank", {"model": DEC, "query": QUERY, "documents": DOCS}).status_code == 200
    post(server, "/v1/rerank", {"model": CE, "query": QUERY, "documents": []})
    text = httpx.get(server.url + "/metrics").text
    assert 'pyllama_requests_total{route="/v1/rerank",status="200"}' in text
    assert 'pyllama_requests_total{route="/v1/rerank",status="400"}' in text
    assert server.app.state.pp.metrics.prompt_tokens > before
    assert server.app.state.pp.metrics.inflight[DEC] == 0
    wait_until(lambda: httpx.get(server.url + "/api/pool", params={"model": DEC}).json()["stats"]["blocks_used"] == 0,
               what="the decoder reranker's pages freed")
