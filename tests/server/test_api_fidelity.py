"""The fields real OpenAI and Ollama clients send, and the answers they expect
(issue 14, item 3): defaults, nullable fields, error shapes and codes, prompt
lists and token-id prompts, echo and logprobs, model retrieval, num_ctx,
truncate, keep_alive, raw, think, suffix, model management, tool history."""

import json

import httpx
import numpy as np
import ollama
import openai
import pytest

from pyllama_paged.testing.agreement import NEAR_TIE, engine_logits
from pyllama_paged.testing.serving import Running, wait_pool_empty
from pyllama_paged.engine.worker.sampler import log_softmax
from pyllama_paged.calls.sampling_options import BASE_MODEL_MAX_TOKENS, OLLAMA, OPENAI, sampling_params
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME

M = DEFAULT_MODEL_NAME
KEY = "fidelity-key"


SERVE = dict(n_ctx=512, n_threads=2, n_batch=256, block_size=32, kv_budget_tokens=8192, max_num_seqs=64)
LIMITS = Limits(max_tokens=600, max_n=4)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=300, **kw)


# ---- defaults -----------------------------------------------------------------
def test_defaults_are_the_references():
    # unset num_predict / max_tokens: to the context (0), not 512; Ollama's repeat_penalty is 1.0
    ollama_params = sampling_params(OLLAMA, {"num_predict": None})
    assert ollama_params.max_tokens == 0 and ollama_params.repeat_penalty == 1.0
    assert sampling_params(OLLAMA, {"num_predict": -1}).max_tokens == 0
    assert sampling_params(OPENAI, {"max_tokens": None, "temperature": None}).temperature == 1.0


def test_unset_length_is_the_server_limit_not_512(server, registry):
    served = registry.get(M)
    body = {"model": M, "prompt": "hi", "stream": False}
    captured = []
    original = served.loop.submit

    def spy(ids, params, *a, **k):
        captured.append(params.max_tokens)
        return original(ids, params, *a, **k)

    served.loop.submit = spy
    try:
        assert post(server, "/api/generate", {**body, "options": {"num_predict": 1}}).status_code == 200
        captured.clear()
        # a stop string ends it at once; what matters is the length it was allowed
        r = post(server, "/api/generate", {**body, "options": {"stop": ["\n", " ", "."]}})
        r2 = post(server, "/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}],
                                                   "stop": ["\n", " ", "."]})
    finally:
        served.loop.submit = original
    assert r.status_code == 200 and r2.status_code == 200
    # the default model has no chat template (a base model): an unset length is run's, under the
    # server's limit (600); a model with a template gets the limit (test_thinking_budget.py)
    assert captured == [BASE_MODEL_MAX_TOKENS, BASE_MODEL_MAX_TOKENS]


def test_prompt_longer_than_the_context_is_truncated_as_ollama_does(server):
    long = "word " * 700
    r = post(server, "/api/generate", {"model": M, "prompt": long, "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] <= 511
    r = post(server, "/api/generate", {"model": M, "prompt": long, "truncate": False, "options": {"num_predict": 2}})
    assert r.status_code == 400 and "limit" in r.json()["error"]
    # chat: the oldest turns go first, the last message stays
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 60}
             for i in range(12)] + [{"role": "user", "content": "The last question?"}]
    r = ollama.Client(host=server.url).chat(model=M, messages=turns, options={"num_predict": 2})
    assert r.prompt_eval_count <= 511 and r.done


def test_num_ctx_bounds_prompt_and_answer(server):
    r = post(server, "/api/generate", {"model": M, "prompt": "word " * 100, "stream": False,
                                       "options": {"num_ctx": 64}})
    body = r.json()
    assert r.status_code == 200 and body["prompt_eval_count"] <= 63
    assert body["prompt_eval_count"] + body["eval_count"] <= 64


def test_show_reports_the_served_context(server):
    shown = ollama.Client(host=server.url).show(M)
    assert shown.modelinfo["gemma3.context_length"] == 512
    assert "tools" in shown.capabilities


def test_version_is_one_ide_clients_accept(server):
    version = httpx.get(server.url + "/api/version").json()["version"]
    assert tuple(int(p) for p in version.split(".")) >= (0, 6, 4)


# ---- OpenAI: nulls, errors, model retrieval -----------------------------------
def test_openai_fields_may_be_null(server):
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "stop", "seed", "presence_penalty",
                               "frequency_penalty", "logit_bias", "user", "stream_options", "logprobs",
                               "top_logprobs", "response_format", "tools", "tool_choice",
                               "parallel_tool_calls", "max_completion_tokens")}
    r = post(server, "/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "stop", "seed", "echo", "logprobs",
                               "suffix", "best_of", "user", "logit_bias")}
    r = post(server, "/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text


def test_openai_error_codes_and_shapes(server, registry, oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    assert oai.models.retrieve(M).id == M
    keyed = Running(create_app(registry, Limits(), api_key=KEY))
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
    finally:
        keyed.close()
    for method, path, status in (("GET", "/v1/nope", 404), ("DELETE", "/v1/chat/completions", 405),
                                 ("POST", "/v1/chat/completions", 400)):
        r = httpx.request(method, server.url + path, json={"model": M})
        body = r.json()["error"]
        assert r.status_code == status and set(body) == {"message", "type", "param", "code"}, r.text
    for method, path, status in (("GET", "/api/nope", 404), ("GET", "/api/chat", 405), ("POST", "/api/chat", 400)):
        r = httpx.request(method, server.url + path, json={"messages": 5})
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
    r = post(server, "/v1/completions", {"model": M, "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix" and "suffix" in r.text
    for bias in ({"262144": 1}, {"x": 1}, {"5": 101}):
        r = post(server, "/v1/completions", {"model": M, "prompt": "x", "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_logit_bias_steers_both_openai_routes(oai, registry):
    paris = registry.get(M).tokenizer.encode(" Paris", add_special=False)
    assert len(paris) == 1
    r = oai.completions.create(model=M, prompt="The capital of France is", max_tokens=3, temperature=0,
                               logit_bias={str(paris[0]): 100})
    assert r.choices[0].text == " Paris" * 3
    chat = oai.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=1.0, seed=1, logit_bias={str(paris[0]): 100})
    assert chat.choices[0].message.content.split() == ["Paris", "Paris"]
    # a ban moves greedy decoding off its first choice
    greedy = oai.completions.create(model=M, prompt="The capital of France is", max_tokens=1, temperature=0)
    first = registry.get(M).tokenizer.encode(greedy.choices[0].text, add_special=False)
    banned = oai.completions.create(model=M, prompt="The capital of France is", max_tokens=1, temperature=0,
                                    logit_bias={str(first[0]): -100})
    assert len(first) == 1 and banned.choices[0].text != greedy.choices[0].text


# ---- /v1/completions as lm-evaluation-harness uses it -------------------------
def test_completion_prompt_lists_and_token_ids(server, oai, registry):
    tok = registry.get(M).tokenizer
    out = oai.completions.create(model=M, prompt=["The sky is", "Water is"], max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text   # greedy: the two samples of a prompt agree
    ids = [tok.encode("The sky is", add_special=True), tok.encode("Water is", add_special=True)]
    by_ids = oai.completions.create(model=M, prompt=ids, max_tokens=3, temperature=0)
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    streamed = list(oai.completions.create(model=M, prompt=["a", "b"], max_tokens=2, stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
    assert wait_pool_empty(server.url)


def test_echo_with_prompt_logprobs_matches_the_model(server, oai, registry):
    served = registry.get(M)
    ids = served.tokenizer.encode("Paris is the capital of France", add_special=True)
    out = oai.completions.create(model=M, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith("Paris is the capital of France")
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # each against a prefill of its own prefix: equal up to GGML's batch-shape rounding,
    # while an off-by-one position or a wrong row would be whole units away
    logits_of = lambda prefix: served.loop.call(lambda llm: engine_logits(llm.runner)(prefix))
    for k in range(1, len(ids)):
        expected = log_softmax(np.asarray(logits_of(ids[:k])))[ids[k]]
        assert abs(lp.token_logprobs[k] - expected) < NEAR_TIE, (k, lp.token_logprobs[k], expected)
    assert lp.text_offset[1] == len(lp.tokens[0])
    assert wait_pool_empty(server.url)


def test_chat_logprobs_and_top_logprobs(oai):
    r = oai.chat.completions.create(model=M, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[-1].logprob
    assert "".join(c.token for c in content) == r.choices[0].message.content
    chunks = list(oai.chat.completions.create(model=M, messages=[{"role": "user", "content": "Say hi"}],
                                              max_tokens=4, temperature=0, logprobs=True, stream=True))
    assert any(ch.choices and ch.choices[0].logprobs for ch in chunks)


# ---- Ollama: keep_alive, raw, think, suffix, model management -----------------
def test_keep_alive_raw_think_suffix(server, registry):
    client = ollama.Client(host=server.url)
    client.generate(model=M, prompt="Tell me about cats.", options={"num_predict": 40})
    r = post(server, "/api/generate", {"model": M, "prompt": "", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    assert not registry.get(M).is_loaded and client.ps().models == []
    r = post(server, "/api/generate", {"model": M, "prompt": "hi", "keep_alive": "soon"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    again = client.generate(model=M, prompt="hi", keep_alive="5m", options={"num_predict": 1})
    assert again.load_duration > 0   # the first request after an unload pays the load
    assert client.ps().models[0].expires_at.year < 2100
    start = registry.get(M).tokenizer.token_to_id("<start_of_turn>")
    raw = client.generate(model=M, prompt="<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
                          raw=True, options={"num_predict": 1})
    assert raw.context.count(start) == 2
    with pytest.raises(ollama.ResponseError, match="does not support thinking") as e:
        client.chat(model=M, messages=[{"role": "user", "content": "hi"}], think=True)
    assert e.value.status_code == 400
    assert client.chat(model=M, messages=[{"role": "user", "content": "hi"}], think=False,
                       options={"num_predict": 1}).done
    with pytest.raises(ollama.ResponseError, match="suffix") as e:
        client.generate(model=M, prompt="def f(", suffix="return 1")
    assert e.value.status_code == 400


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_keep_alive_zero_and_expiry_really_unload(server, registry, oai):
    import gc
    import threading
    import time
    import weakref

    client = ollama.Client(host=server.url)
    served = registry.get(M)
    client.generate(model=M, prompt="Tell me about dogs.", options={"num_predict": 8})
    engine = [weakref.ref(x) for x in (served.model, served.engine, served.loop, served.loop.llm)]
    gc.collect()
    before = _rss_bytes()
    r = client.generate(model=M, prompt="hi", keep_alive=0, options={"num_predict": 2})
    assert r.done and client.ps().models == [] and not served.is_loaded
    gc.collect()
    assert all(ref() is None for ref in engine)   # weights, pool, runner and loop are gone
    freed = before - _rss_bytes()
    assert freed > 64 << 20, f"only {freed} bytes released"
    # what describes the model still answers; what reads the engine skips it
    assert M in [m.model for m in client.list().models]
    assert client.show(M).modelinfo["gemma3.context_length"] == served.n_ctx
    assert f'pyllama_kv_blocks_free{{model="{M}"}}' not in httpx.get(server.url + "/metrics").text
    assert httpx.get(server.url + "/api/pool").json()["loaded"] is False
    r = client.generate(model=M, prompt="hi", options={"num_predict": 2})
    assert r.load_duration > 0 and served.is_loaded and [m.model for m in client.ps().models] == [M]
    assert f'pyllama_kv_blocks_free{{model="{M}"}}' in httpx.get(server.url + "/metrics").text
    # a keep_alive duration runs out with nothing in flight: the watcher drops the engine
    client.generate(model=M, prompt="hi", keep_alive="1s", options={"num_predict": 1})
    deadline = time.monotonic() + 60
    while served.is_loaded and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not served.is_loaded and client.ps().models == []
    # keep_alive 0 while another request streams: the engine stays until that one ends
    long = oai.completions.create(model=M, prompt="Count:", max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True})
    first = next(iter(long))
    assert first.choices[0].text is not None and served.is_loaded
    assert client.generate(model=M, prompt="hi", keep_alive=0, options={"num_predict": 1}).done
    # (a figures read of /metrics that outlived its timeout holds the engine a moment longer)
    deadline = time.monotonic() + 30
    while served.active != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.is_loaded and served.active == 1
    rest = threading.Thread(target=lambda: [c for c in long])
    rest.start()
    rest.join(300)
    deadline = time.monotonic() + 60
    while served.is_loaded and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not served.is_loaded   # the last scheduled request's keep_alive (0) applied when it ended
    assert client.generate(model=M, prompt="hi", options={"num_predict": 1}).done


def test_model_management_the_ollama_way(server, monkeypatch, tmp_path):
    from pyllama_paged.testing.model_sources import ModelSources

    client = ollama.Client(host=server.url)
    assert client.pull(M).status == "success"   # a served file: nothing to fetch
    assert [p.status for p in client.pull(M, stream=True)][-1] == "success"
    with ModelSources() as registry_without_models, pytest.raises(ollama.ResponseError) as e:
        # a real pull, from a local registry that has no such model (tests/server/test_pull.py pulls for real)
        monkeypatch.setenv("PYLLAMA_PAGED_REGISTRY", registry_without_models.url)
        client.pull("llama9:900b")
    assert e.value.status_code == 404 and "not found" in str(e.value)
    client.copy(M, "my-gemma")
    assert "my-gemma" in [m.model for m in client.list().models]
    assert client.generate(model="my-gemma", prompt="hi", options={"num_predict": 1}).done
    client.delete("my-gemma")
    assert "my-gemma" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(M)
    assert e.value.status_code == 400
    assert client.create(model="made", from_=M).status == "success"
    client.delete("made")
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="made", from_=M, system="You are a pirate.")
    assert e.value.status_code == 400 and "system" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        client.push(M)
    assert e.value.status_code == 400


# ---- agent loops: tool history and content parts ------------------------------
HISTORY_OPENAI = [
    {"role": "system", "content": [{"type": "text", "text": "You are helpful."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]


def test_tool_history_and_content_parts_are_accepted(server, oai):
    r = oai.chat.completions.create(model=M, messages=HISTORY_OPENAI, max_tokens=3)
    assert r.choices[0].message.role == "assistant"
    client = ollama.Client(host=server.url)
    r = client.chat(model=M, options={"num_predict": 3}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}])
    assert r.done
    bad = post(server, "/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert bad.status_code == 400 and "images are not supported" in bad.json()["error"]["message"]
    bad = post(server, "/v1/chat/completions", {"model": M, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]})
    assert bad.status_code == 400 and "arguments" in bad.json()["error"]["message"]


def test_scoring_a_prompt_without_generating(server, oai, registry):
    # lm-evaluation-harness's loglikelihood requests: echo, logprobs, and max_tokens 0
    ids = registry.get(M).tokenizer.encode("The cat sat on the mat", add_special=True)
    r = oai.completions.create(model=M, prompt=[ids, ids[:4]], max_tokens=0, echo=True, logprobs=1)
    first, second = r.choices
    assert first.text == "The cat sat on the mat" and r.usage.completion_tokens == 0
    assert len(first.logprobs.token_logprobs) == len(ids) and len(second.logprobs.tokens) == 4
    assert first.logprobs.token_logprobs[:4] == pytest.approx(second.logprobs.token_logprobs, abs=NEAR_TIE)
    r = post(server, "/v1/completions", {"model": M, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_ollama_samplers_we_lack_are_refused(server):
    r = post(server, "/api/generate", {"model": M, "prompt": "hi", "options": {"mirostat": 2}})
    assert r.status_code == 400 and "mirostat" in r.json()["error"]
    r = post(server, "/api/generate", {"model": M, "prompt": "hi", "stream": False,
                                       "options": {"mirostat": 0, "typical_p": 1.0, "num_predict": 1}})
    assert r.status_code == 200


def test_structured_output_on_completions_and_llamacpp_fields(server):
    import re

    r = post(server, "/v1/completions", {"model": M, "prompt": "My phone number is ", "max_tokens": 20, "seed": 1,
                                         "grammar": 'root ::= [0-9]{3} "-" [0-9]{4}'})
    assert r.status_code == 200 and re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"]), r.text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for extra in ({"json_schema": schema},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}):
        r = post(server, "/v1/completions", {"model": M, "prompt": ["A:", "B:"], "max_tokens": 20, **extra})
        assert [type(json.loads(c["text"])["ok"]) for c in r.json()["choices"]] == [bool, bool], r.text
    r = post(server, "/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "ok?"}],
                                              "max_tokens": 20, "json_schema": schema})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["ok"], bool)
    r = post(server, "/v1/completions", {"model": M, "prompt": "x", "grammar": "root ::= \"a\"",
                                         "json_schema": schema})
    assert r.status_code == 400 and "grammar and json_schema" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": M, "prompt": "x", "grammar": "root ::= ("})
    assert r.status_code == 400 and "GBNF" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_chat_fields_we_cannot_honour_are_a_400(server, extra, param):
    r = post(server, "/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 1, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
