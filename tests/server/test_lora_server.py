"""LoRA adapters on the server (issue 54 item 4): `--lora NAME=FILE[:SCALE]` lists each adapter
as a model in /v1/models and /api/tags, the unmodified openai client picks one by model name,
llama-server's per-request `lora` field picks one by id; the prompt's log-probabilities under
each match the float64 reference W + scale * alpha / rank * B A."""

import httpx
import numpy as np
import openai
import pytest

from pyllama_paged.errors import PagedError
from pyllama_paged.server.app import create_app
from pyllama_paged.server.config import ServeConfig, lora_option
from pyllama_paged.server.registry import ModelRegistry
from pyllama_paged.testing.reference.numpy_model import ReferenceModel
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_lora import with_lora, write_tiny_lora
from pyllama_paged.testing.serving import Running

PROMPT = [2] + [int(x) for x in np.random.default_rng(4).integers(4, 200, size=15)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_model(root / "tiny.gguf", "gemma3", weight_type="q8_0")
    return {"base": base, "sql": write_tiny_lora(root / "sql.gguf", base, seed=1),
            "chat": write_tiny_lora(root / "chat.gguf", base, seed=2, targets=("attn_q", "ffn_down"))}


@pytest.fixture(scope="module")
def server(files):
    loras = [lora_option(f"sql={files['sql']}"), lora_option(f"Chat={files['chat']}:0.5")]
    registry = ModelRegistry([files["base"]], ServeConfig.flat(n_ctx=128, n_threads=2, n_batch=64, kv_tokens=1024,
                                                               loras=loras))
    running = Running(create_app(registry))
    yield running
    running.close()
    registry.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def reference_logprobs(files, adapter, scale):
    ref = ReferenceModel.from_gguf(files["base"])
    if adapter is not None:
        ref = with_lora(ref, files[adapter], scale)
    logits = ref.forward(PROMPT)
    logits = logits - logits.max(-1, keepdims=True)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.array([lp[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))])


def scored(oai, model, **extra):
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                               extra_body=extra or None)
    return np.array(r.choices[0].logprobs.token_logprobs[1:], dtype=float)


def test_adapters_are_listed_as_models(oai, server):
    cards = {m.id: m for m in oai.models.list().data}
    assert {"tiny", "sql", "chat"} <= set(cards)
    assert cards["sql"].model_extra["parent"] == "tiny" and cards["chat"].model_extra["parent"] == "tiny"
    assert oai.models.retrieve("chat").model_extra["parent"] == "tiny"
    tags = {m["name"] for m in httpx.get(f"{server.url}/api/tags").json()["models"]}
    assert {"tiny", "sql", "chat"} <= tags
    listed = httpx.get(f"{server.url}/lora-adapters").json()
    assert [(a["id"], a["name"], a["scale"]) for a in listed] == [(0, "sql", 1.0), (1, "chat", 0.5)]


def test_the_model_name_picks_the_adapter(oai, files):
    for model, adapter, scale in (("tiny", None, 1.0), ("sql", "sql", 1.0), ("chat", "chat", 0.5)):
        got, want = scored(oai, model), reference_logprobs(files, adapter, scale)
        assert np.abs(got - want).mean() < 0.05 and np.abs(got - want).max() < 0.3, model
    assert np.abs(reference_logprobs(files, "sql", 1.0) - reference_logprobs(files, None, 1.0)).mean() > 0.3


def test_llama_server_lora_field(oai, files):
    got = scored(oai, "tiny", lora=[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 2.0}])
    want = reference_logprobs(files, "chat", 2.0)
    assert np.abs(got - want).mean() < 0.05
    assert np.allclose(scored(oai, "sql", lora=[{"id": 0, "scale": 0.0}]), reference_logprobs(files, None, 1.0),
                       atol=0.3)   # the field overrides the name: scale 0 everywhere is no adapter
    for lora, words in (([{"id": 5, "scale": 1.0}], "lora id 5"),
                        ([{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}], "one LoRA adapter per request")):
        with pytest.raises(openai.BadRequestError, match=words):
            scored(oai, "tiny", lora=lora)


def test_chat_with_an_adapter_streams(oai):
    """A chat through the openai client on an adapter: answered, and named as asked."""
    r = oai.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.model == "sql"
    chunks = list(oai.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, stream=True))
    assert chunks and {c.model for c in chunks} == {"chat"}
    assert oai.completions.create(model="tiny", prompt="hi", max_tokens=2).model == "tiny"


def test_bad_adapters_are_refused_at_start(files, tmp_path):
    for loras, words in (([lora_option(f"tiny={files['sql']}")], "already a model"),
                         ([lora_option(f"x={files['base']}")], "not an adapter")):
        with pytest.raises(PagedError, match=words):
            ModelRegistry([files["base"]], ServeConfig.flat(n_ctx=128, n_threads=2, kv_tokens=1024, loras=loras))
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=FILE"):
        lora_option("just-a-file.gguf")


def test_adapters_load_and_unload_at_run_time(files, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter with --lora-runtime: a loaded
    adapter is listed and answers by name, a name taken or a file that is no adapter is refused,
    an unloaded one is gone; without the flag both are refused."""
    registry = ModelRegistry([files["base"]], ServeConfig.flat(n_ctx=128, n_threads=2, n_batch=64, kv_tokens=1024,
                                                               lora_runtime=True))
    running = Running(create_app(registry))
    oai = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
    try:
        url = running.url + "/v1/"
        r = httpx.post(url + "load_lora_adapter", json={"lora_name": "sql", "lora_path": files["sql"]})
        assert r.status_code == 200 and "added" in r.text
        assert "sql" in {m.id for m in oai.models.list().data}
        got = scored(oai, "sql")
        assert np.abs(got - reference_logprobs(files, "sql", 1.0)).mean() < 0.05
        for body, status, words in (({"lora_name": "sql", "lora_path": files["chat"]}, 400, "already"),
                                    ({"lora_name": "cv", "lora_path": files["base"]}, 400, "not an adapter")):
            r = httpx.post(url + "load_lora_adapter", json=body)
            assert r.status_code == status and words in r.text, r.text
        assert httpx.post(url + "unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        assert "sql" not in {m.id for m in oai.models.list().data}
        assert httpx.post(url + "unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            scored(oai, "sql")
    finally:
        running.close()
        registry.close()


def test_run_time_loading_is_off_by_default(server, files):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": files["sql"]})
    assert r.status_code == 403 and "--lora-runtime" in r.text
