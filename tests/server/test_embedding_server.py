"""Embedding routes through the unmodified clients users bring (issue 15): ollama
(embed, embeddings), openai (float and base64), langchain-ollama's OllamaEmbeddings,
langchain-openai's OpenAIEmbeddings (token arrays by default, text with
check_embedding_ctx_length=False) and litellm, against a real server holding a tiny
BERT (converted by our tool) beside the default chat model; errors and refusals."""

import base64
import os
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of litellm's price list

import httpx  # noqa: E402
import litellm  # noqa: E402
import numpy as np  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from langchain_ollama import OllamaEmbeddings  # noqa: E402
from langchain_openai import OpenAIEmbeddings  # noqa: E402

from pyllama_paged import Llama  # noqa: E402
from pyllama_paged.convert.bert_gguf import convert  # noqa: E402
from pyllama_paged.engine import default_model_path  # noqa: E402
from pyllama_paged.server.app import create_app  # noqa: E402
from pyllama_paged.server.generation import Limits  # noqa: E402
from pyllama_paged.server.registry import ModelRegistry, model_name_for  # noqa: E402
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.testing.reference.tiny_bert import write_tiny_bert  # noqa: E402
from pyllama_paged.testing.serving import Running, wait_pool_empty  # noqa: E402

# tiktoken's cl100k_base, for langchain-openai's token arrays (client and server side): the
# copy litellm ships, so nothing is downloaded
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path(litellm.__file__).parent / "litellm_core_utils" / "tokenizers"))

BERT = "tiny-bert"
CHAT = model_name_for(default_model_path())
TEXTS = ["the cat sat on the mat.", "hello world", "dogs running fast at night"]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    write_tiny_bert(root / "hf")
    return str(convert(root / "hf", root / f"{BERT}.gguf", "f32"))


@pytest.fixture(scope="module")
def expected(bert_path):
    """The vectors the Python API gives (normalized and raw), for every client to match."""
    with Llama(bert_path, n_threads=2) as llm:
        return np.array(llm.embed(TEXTS)), np.array(llm.embed(TEXTS, normalize=False))


@pytest.fixture(scope="module")
def server(bert_path):
    registry = ModelRegistry([bert_path, default_model_path()],
                             ServeConfig.flat(n_ctx=512, n_threads=2, n_batch=128, kv_budget_tokens=4096))
    s = Running(create_app(registry, Limits(max_embedding_inputs=16)))
    yield s
    s.close()
    registry.close()


def close(a, b, atol=1e-5):
    return np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max() < atol


def test_ollama_client(server, expected):
    client = ollama.Client(host=server.url)
    r = client.embed(model=BERT, input=TEXTS)
    assert close(r.embeddings, expected[0]) and r.prompt_eval_count > len(TEXTS)
    assert r.total_duration > 0 and r.load_duration == 0 and r.model == BERT
    assert close(client.embed(model=BERT, input=TEXTS[0]).embeddings, expected[0][:1])
    short = client.embed(model=BERT, input=TEXTS[0], dimensions=8).embeddings[0]
    assert len(short) == 8 and abs(np.linalg.norm(short) - 1) < 1e-5
    legacy = client.embeddings(model=BERT, prompt=TEXTS[1]).embedding   # Ollama's legacy: not normalized
    assert close(legacy, expected[1][1], 1e-4)


def test_openai_client_float_and_base64(server, expected):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    for fmt in ("float", openai.NOT_GIVEN):   # not told, the client asks for base64 and decodes it
        r = client.embeddings.create(model=BERT, input=TEXTS, encoding_format=fmt)
        assert close([d.embedding for d in r.data], expected[0]) and [d.index for d in r.data] == [0, 1, 2]
        assert r.usage.prompt_tokens == r.usage.total_tokens > 0 and r.model == BERT
    r = client.embeddings.create(model=BERT, input=TEXTS, encoding_format="base64")   # asked: the string itself
    assert close([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in r.data], expected[0])
    r = client.embeddings.create(model=BERT, input=TEXTS[0], dimensions=16)
    assert len(r.data[0].embedding) == 16


def test_langchain_embeddings(server, expected):
    lc_ollama = OllamaEmbeddings(model=BERT, base_url=server.url)
    assert close(lc_ollama.embed_documents(TEXTS), expected[0])
    assert close(lc_ollama.embed_query(TEXTS[2]), expected[0][2])
    # default: langchain tokenizes with tiktoken and posts cl100k token arrays
    tokens = OpenAIEmbeddings(model=BERT, base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert close(tokens.embed_documents(TEXTS), expected[0])
    plain = OpenAIEmbeddings(model=BERT, base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                             check_embedding_ctx_length=False)
    assert close(plain.embed_query(TEXTS[1]), expected[0][1])


def test_litellm_embedding(server, expected):
    r = litellm.embedding(model=f"openai/{BERT}", api_base=f"{server.url}/v1", api_key="x", input=TEXTS)
    assert close([d["embedding"] for d in r.data], expected[0])
    r = litellm.embedding(model=f"ollama/{BERT}", api_base=server.url, input=TEXTS[:2])
    assert close([d["embedding"] for d in r.data], expected[0][:2])


def test_chat_model_embeds_through_its_scheduler(server):
    client = ollama.Client(host=server.url)
    a = np.array(client.embed(model=CHAT, input=["The sky is blue.", "The sky is blue."] + TEXTS).embeddings)
    assert a.shape == (5, 640) and close(a[0], a[1]) and np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    b = oai.embeddings.create(model=CHAT, input="The sky is blue.").data[0].embedding
    assert close(b, a[0], 1e-4)
    assert wait_pool_empty(server.url)


def test_bad_requests_are_400s_and_leave_nothing(server):
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, timeout=60)  # noqa: E731
    r = post("/v1/embeddings", {"model": BERT, "input": []})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input is empty")
    r = post("/api/embed", {"model": BERT, "input": []})
    assert r.status_code == 400 and "input is empty" in r.json()["error"]
    r = post("/api/embed", {"model": BERT, "input": ["ok", "the " * 100], "truncate": False})
    assert r.status_code == 400 and r.json()["error"].startswith("input 1 is 102 tokens; the model takes at most 64")
    assert post("/api/embed", {"model": BERT, "input": "the " * 100}).status_code == 200   # truncate: Ollama's default
    r = post("/v1/embeddings", {"model": BERT, "input": "the " * 100})   # OpenAI refuses over-long input
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = post("/api/embed", {"model": CHAT, "input": ["x " * 600], "truncate": False})
    assert r.status_code == 400 and "the model takes at most 511" in r.json()["error"]
    assert post("/api/embed", {"model": BERT, "input": ["a"] * 17}).status_code == 400   # over the input limit
    assert post("/api/embed", {"model": BERT, "input": "x", "dimensions": 65}).status_code == 400
    assert post("/v1/embeddings", {"model": BERT, "input": "x", "encoding_format": "int8"}).status_code == 400
    assert post("/v1/embeddings", {"model": BERT, "input": [[10**9]]}).status_code == 400
    assert post("/v1/embeddings", {"model": "nope", "input": "x"}).status_code == 404
    assert post("/api/embed", {"model": BERT}).json()["embeddings"] == []   # Ollama's load
    assert post("/api/embeddings", {"model": BERT, "prompt": ""}).json() == {"embedding": []}
    assert post("/api/embed", {"model": CHAT, "input": "hi", "keep_alive": 0}).status_code == 200
    assert post("/api/embed", {"model": BERT, "input": "hi", "keep_alive": "soon"}).status_code == 400
    assert wait_pool_empty(server.url)
    assert httpx.get(f"{server.url}/api/pool", params={"model": BERT}).json()["stats"]["waiting_requests"] == 0


def test_embedding_model_refuses_generation(server):
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, timeout=60)  # noqa: E731
    for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/api/generate", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = post(path, {"model": BERT, **body})
        assert r.status_code == 400, path
        error = r.json()["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert "is an embedding model (bert): it does not generate text" in message
    with pytest.raises(ollama.ResponseError, match="embedding model"):
        ollama.Client(host=server.url).chat(model=BERT, messages=[{"role": "user", "content": "hi"}])
    show = httpx.post(f"{server.url}/api/show", json={"model": BERT}).json()
    assert show["capabilities"] == ["embedding"] and show["architecture"] == "bert"
    assert {m["name"] for m in httpx.get(f"{server.url}/api/tags").json()["models"]} >= {BERT}
    assert httpx.get(f"{server.url}/api/ps").status_code == 200
