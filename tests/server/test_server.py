"""The HTTP server on a loopback port, driven by the unmodified `ollama` and
`openai` client packages and by raw HTTP for the error cases."""

import concurrent.futures
import json
import time

import httpx
import ollama
import openai
import pytest

from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits
from pyllama_paged.testing.loop_control import paused
from pyllama_paged.testing.serving import Running, default_model_names, pool_used, tiny_registry, wait_pool_empty, wait_until
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME

KEY = "sekrit-key"


SERVE = dict(n_ctx=512, n_threads=2, n_batch=256, block_size=32, kv_budget_tokens=8192, max_num_seqs=64)
LIMITS = Limits(max_body_bytes=64 * 1024, max_tokens=256, max_n=4)


@pytest.fixture(scope="module")
def keyed_server(registry):
    s = Running(create_app(registry, Limits(), api_key=KEY))
    yield s
    s.close()


GREEDY = {"num_predict": 10, "temperature": 0}


# ---- the ollama client ------------------------------------------------------
def test_ollama_generate_chat_and_listing(server):
    client = ollama.Client(host=server.url)
    r = client.generate(model=DEFAULT_MODEL_NAME, prompt="Why is the sky blue?", options=GREEDY, stream=False)
    assert r.done and r.done_reason == "length" and r.eval_count == 10 and r.response
    assert r.total_duration > 0 and r.prompt_eval_count > 0
    parts = list(client.generate(model=DEFAULT_MODEL_NAME, prompt="Why is the sky blue?", options=GREEDY,
                                 stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done
    c = client.chat(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}], options=GREEDY)
    assert c.message.role == "assistant" and c.message.content
    streamed = list(client.chat(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}],
                                options=GREEDY, stream=True))
    assert "".join(p.message.content for p in streamed) == c.message.content
    names = [m.model for m in client.list().models]
    assert names == default_model_names()
    assert client.show(DEFAULT_MODEL_NAME).details.family == "gemma3"
    ps = client.ps()
    assert ps.models[0].model == DEFAULT_MODEL_NAME
    raw = httpx.get(f"{server.url}/api/ps").json()["models"][0]["kv_cache"]
    # 8192 tokens of every layer, in blocks of one of Gemma 3 270M's six layer groups
    assert raw["paged"] and raw["blocks_total"] == 6 * 256 and raw["bytes"] == 8192 * 18432
    assert httpx.get(f"{server.url}/api/version").json()["version"]


def test_ollama_unknown_model_is_404_with_the_list(server):
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url).generate(model="llama9:900b", prompt="hi")
    assert e.value.status_code == 404 and DEFAULT_MODEL_NAME in str(e.value)


# ---- the openai client ------------------------------------------------------
def test_openai_completions_chat_models(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == default_model_names()
    c = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=DEFAULT_MODEL_NAME, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hi"}])
    text = chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL_NAME, max_tokens=8, temperature=0,
                                                 messages=[{"role": "user", "content": "Say hi"}], stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == 8
    many = client.chat.completions.create(model=DEFAULT_MODEL_NAME, max_tokens=6, temperature=1.0, seed=5, n=3,
                                          messages=[{"role": "user", "content": "Name a fruit"}])
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    stopped = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is",
                                        max_tokens=8, temperature=0, stop=[c.choices[0].text.split()[1]])
    assert stopped.choices[0].finish_reason == "stop"
    assert wait_pool_empty(server.url)


def test_openai_errors_have_openai_shape(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found" and DEFAULT_MODEL_NAME in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL_NAME, prompt="x", n=50)
    assert e.value.body["param"] == "n"


# ---- raw HTTP error cases ---------------------------------------------------
@pytest.mark.parametrize("path,body,status,needle", [
    ("/api/generate", b'{"model": "gemma3:270m-base", "prompt": ', 400, "malformed JSON"),
    ("/v1/completions", b'{not json', 400, "malformed JSON"),
    ("/api/generate", json.dumps({"model": "gemma3:270m-base", "prompt": 5}).encode(), 400, "prompt"),
    ("/api/chat", json.dumps({"model": "gemma3:270m-base", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
     400, "messages.0.role"),
    ("/v1/chat/completions", json.dumps({"model": "gemma3:270m-base", "messages": [], "max_tokens": 2}).encode(),
     400, "messages"),
    ("/v1/completions", json.dumps({"model": "gemma3:270m-base", "prompt": "x", "temperature": "hot"}).encode(),
     400, "temperature"),
    ("/v1/completions", json.dumps({"model": "gemma3:270m-base", "prompt": "x", "max_tokens": 100000}).encode(),
     400, "max_tokens"),
    ("/api/generate", json.dumps({"model": "gemma3:270m-base", "prompt": "word " * 600, "truncate": False}).encode(),
     400, "limit"),
    ("/v1/completions", json.dumps({"model": "gemma3:270m-base", "prompt": "word " * 600}).encode(), 400, "limit"),
    ("/api/generate", json.dumps({"model": "zzz", "prompt": "x"}).encode(), 404, "gemma3:270m-base"),
    ("/api/generate", json.dumps({"model": "gemma3:270m-base", "prompt": "x" * 70000}).encode(), 413, "larger than"),
])
def test_bad_requests_get_clear_4xx(server, path, body, status, needle):
    # httpx's default 5 s is a timing assumption a loaded CI machine breaks: a deadline for a hang only
    r = httpx.post(server.url + path, content=body, timeout=120)
    assert r.status_code == status, r.text
    assert needle in r.text
    # and the server keeps serving
    ok = httpx.post(server.url + "/api/generate", json={"model": DEFAULT_MODEL_NAME, "prompt": "hi",
                                                        "stream": False, "options": {"num_predict": 1}}, timeout=120)
    assert ok.status_code == 200


def test_api_key_checked_on_every_route(keyed_server):
    routes = (("GET", "/api/tags"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/dashboard"),
              ("POST", "/api/generate"), ("GET", "/api/pool"), ("GET", "/openapi.json"), ("GET", "/api/ps"))
    ways = {"query": lambda k: {"params": {"key": k}}, "x-api-key": lambda k: {"headers": {"X-API-Key": k}},
            "bearer": lambda k: {"headers": {"Authorization": f"Bearer {k}"}}}
    for method, path in routes:
        r = httpx.request(method, keyed_server.url + path, json={"model": DEFAULT_MODEL_NAME, "prompt": "x"})
        assert r.status_code == 401, path
        for way, given in ways.items():
            r = httpx.request(method, keyed_server.url + path, **given("wrong"))
            assert r.status_code == 401, (path, way)
    for way, given in ways.items():
        for path in ("/api/pool", "/openapi.json", "/api/tags", "/dashboard"):
            r = httpx.get(keyed_server.url + path, **given(KEY))
            assert r.status_code == 200, (path, way)
        assert "blocks" in httpx.get(keyed_server.url + "/api/pool", **given(KEY)).json()
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY)
    assert good.models.list().data[0].id == DEFAULT_MODEL_NAME
    ok = ollama.Client(host=keyed_server.url, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.list().models


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Write a long essay about rivers.", "max_tokens": 256, "ignore_eos": True,
                         "temperature": 0, "stream": True}),
    ("/api/generate", {"prompt": "Write a long essay about rivers.", "options": {"num_predict": 256, "temperature": 0}}),
])
def test_client_hanging_up_mid_stream_returns_its_pages(server, registry, path, body):
    # The pages must come back because the client left, not because the answer ran to its
    # end: the request stops well short of max_tokens (ignore_eos: it cannot end earlier).
    def stats():
        return httpx.get(server.url + "/api/pool").json()["stats"]

    assert wait_pool_empty(server.url)
    before = stats()
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + path, json={"model": DEFAULT_MODEL_NAME, **body}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert pool_used(server.url) > before["blocks_used"]
    loop = registry.get(DEFAULT_MODEL_NAME).loop
    wait_until(lambda: loop.call(lambda llm: llm.has_work()) is False, timeout=120, what="the abort")
    after = stats()
    assert after["blocks_used"] == before["blocks_used"]
    # stopped short of its 256 tokens (how far short depends on how busy the machine is: the
    # client's hang-up reaches the engine a loop turn or more after it happens)
    assert after["generated_tokens"] - before["generated_tokens"] < 256


@pytest.mark.parametrize("path, body", [
    ("/api/generate", {"model": DEFAULT_MODEL_NAME, "prompt": "Write a long essay about rivers.", "stream": False,
                       "options": {"num_predict": 256, "temperature": 0}}),
    ("/v1/chat/completions", {"model": DEFAULT_MODEL_NAME, "max_tokens": 256, "temperature": 0, "n": 2,
                              "messages": [{"role": "user", "content": "Write a long essay about rivers."}]}),
])
def test_client_hanging_up_on_a_non_streamed_answer_aborts_it(server, registry, path, body):
    # found by bench/serving/soak.py: a client that gave up waiting (timeout) left its request
    # decoding to max_tokens, holding pages and compute for nobody. The engine loop is
    # held while the client gives up, so the request cannot have finished first.
    def stats():
        return httpx.get(server.url + "/api/pool").json()["stats"]

    assert wait_pool_empty(server.url)
    before = stats()["generated_tokens"]
    loop = registry.get(DEFAULT_MODEL_NAME).loop
    with paused(loop):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + path, json=body, timeout=httpx.Timeout(60, read=1.0))
        end = time.monotonic() + 120   # the server notices the hang-up (a deadline for a hang only)
        counts = server.app.state.pp.metrics.requests   # /metrics would wait for the held loop
        while counts[(path, 499)] == 0:
            assert time.monotonic() < end, "the hang-up was never noticed"
            time.sleep(0.05)
    assert wait_pool_empty(server.url)
    assert loop.call(lambda llm: llm.has_work()) is False
    assert stats()["generated_tokens"] == before


def test_engine_step_failure_ends_every_answer_with_an_api_error(server, registry, monkeypatch):
    # found by bench/serving/soak.py (a step failed under preemption): non-streamed clients got a bare
    # 500 with a traceback in the log, streams were cut without an end line or an error
    def boom():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(registry.models[DEFAULT_MODEL_NAME].loop.llm, "step", boom)
    ollama_body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hello", "options": {"num_predict": 8}}
    openai_body = {"model": DEFAULT_MODEL_NAME, "prompt": "Hello", "max_tokens": 8}
    r = httpx.post(server.url + "/api/generate", json={**ollama_body, "stream": False}, timeout=60)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]
    r = httpx.post(server.url + "/v1/completions", json=openai_body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    r = httpx.post(server.url + "/api/generate", json=ollama_body, timeout=60)
    assert r.status_code == 200 and "injected step failure" in json.loads(r.text.splitlines()[-1])["error"]
    r = httpx.post(server.url + "/v1/completions", json={**openai_body, "stream": True}, timeout=60)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError, match="injected step failure"):
        list(openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").completions.create(
            model=DEFAULT_MODEL_NAME, prompt="Hello", max_tokens=8, stream=True))
    with pytest.raises(ollama.ResponseError, match="injected step failure"):
        list(ollama.Client(host=server.url).generate(model=DEFAULT_MODEL_NAME, prompt="Hello", stream=True,
                                                      options={"num_predict": 8}))
    monkeypatch.undo()
    assert wait_pool_empty(server.url)
    r = httpx.post(server.url + "/v1/completions", json=openai_body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    text = httpx.get(server.url + "/metrics").text
    assert 'pyllama_requests_total{route="/api/generate",status="500"}' in text


def test_unhandled_error_is_counted_as_500(server, registry, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected template failure")

    # every chat is rendered through render_with (render and render_chat call it)
    monkeypatch.setattr(registry.models[DEFAULT_MODEL_NAME].template, "render_with", broken)
    r = httpx.post(server.url + "/api/chat", timeout=60, json={"model": DEFAULT_MODEL_NAME,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    monkeypatch.undo()
    text = httpx.get(server.url + "/metrics").text
    assert 'pyllama_requests_total{route="/api/chat",status="500"}' in text


def test_many_concurrent_clients_match_single_user(server, registry):
    prompts = [f"Tell me fact number {i} about the ocean." for i in range(16)]

    def ask(p):
        r = httpx.post(server.url + "/api/generate", timeout=300,
                       json={"model": DEFAULT_MODEL_NAME, "prompt": p, "stream": False,
                             "options": {"num_predict": 12, "temperature": 0, "repeat_penalty": 1.0}})
        r.raise_for_status()
        body = r.json()
        assert body["response"]
        n = body["prompt_eval_count"]
        return body["context"][:n], body["context"][n:]   # prompt ids, answer ids

    single = [ask(p) for p in prompts[:4]]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(ask, prompts))
    # Each answer beside 15 others equals the one given alone, up to near-ties
    # of the logits (GGML's kernels differ by batch shape; pyllama_paged/testing/agreement.py).
    served = registry.get(DEFAULT_MODEL_NAME)
    logits_of = lambda ids: served.loop.call(lambda llm: engine_logits(llm.runner)(ids))
    for (prompt, alone), (prompt_again, got) in zip(single, together[:4]):
        assert prompt == prompt_again
        assert_greedy_agree(prompt, alone, got, logits_of, served.tokenizer.eot_ids)
    assert wait_pool_empty(server.url)
    stats = httpx.get(server.url + "/api/pool").json()["stats"]
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]


def test_generate_context_continues_the_exchange(server):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Name a color.", "stream": False,
            "options": {"num_predict": 4, "temperature": 0}}
    first = httpx.post(server.url + "/api/generate", json=body, timeout=300).json()
    assert len(first["context"]) == first["prompt_eval_count"] + first["eval_count"] or \
        len(first["context"]) == first["prompt_eval_count"] + first["eval_count"] - 1   # end of turn left out
    second = httpx.post(server.url + "/api/generate", timeout=300,
                        json={**body, "prompt": "Another one.", "context": first["context"]}).json()
    assert second["prompt_eval_count"] > len(first["context"])
    assert second["context"][:len(first["context"])] == first["context"]
    bad = httpx.post(server.url + "/api/generate", json={**body, "context": [10 ** 9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]


def test_metrics_and_dashboard(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("pyllama_requests_total", "pyllama_queue_depth", "pyllama_running_sequences",
                 "pyllama_kv_blocks_free", "pyllama_kv_blocks_shared", "pyllama_kv_blocks_cached",
                 "pyllama_kv_utilization", "pyllama_prefix_cache_hit_rate",
                 "pyllama_time_to_first_token_seconds_bucket", "pyllama_inter_token_latency_seconds_count"):
        assert name in text
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "/api/pool" in page.text
    assert "pyllama_kv_pool_bytes" in text and "pyllama_kv_bytes_used" in text
    pool = httpx.get(server.url + "/api/pool").json()
    # 8192 tokens of every layer, in bytes, cut into blocks of one layer group (6 for Gemma 3 270M)
    assert pool["stats"]["kv_pool_bytes"] == 8192 * 18432
    assert len(pool["blocks"]) == 6 * 256 and set(pool["blocks"]) <= {"free", "used", "shared", "cached"}
    groups = pool["stats"]["kv_groups"]
    assert [g["window"] for g in groups] == [0, 512, 512, 512, 512, 512]
    assert all(g["bytes_per_token"] == 3072 for g in groups)


def test_queue_full_is_503_with_retry_hint(tmp_path):
    # A real limit and a real burst: 2 may run and 2 wait, and the engine is held so that
    # none finishes. The check used to be apart from the count (an await between them), so
    # a burst overshot it, and embedding requests were not counted at all.
    reg = tiny_registry(tmp_path, max_num_seqs=2)
    s = Running(create_app(reg, Limits(max_queue=2)))
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as ex:
            with paused(reg.get("tiny").loop):
                burst = [ex.submit(httpx.post, s.url + "/api/generate", json=body, timeout=60) for _ in range(12)]
                wait_until(lambda: sum(f.done() for f in burst) >= 8, what="the refusals")
                for r in [f.result() for f in burst if f.done()]:
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                    assert "retry" in r.json()["error"]
                r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
                assert r.status_code == 503 and r.json()["error"]["type"] == "server_busy"
                # prompt scoring takes a place too (it used to skip the queue and wait on the engine)
                r = httpx.post(s.url + "/v1/completions", timeout=30, json={
                    "model": "tiny", "prompt": "hi there", "max_tokens": 0, "echo": True, "logprobs": 1})
                assert r.status_code == 503 and r.json()["error"]["type"] == "server_busy"
                for path in ("/api/embed", "/v1/embeddings"):
                    r = httpx.post(s.url + path, json={"model": "tiny", "input": "hi"})
                    assert r.status_code == 503, path
            assert sorted(f.result().status_code for f in burst) == [200] * 4 + [503] * 8
        # every place is given back
        assert s.app.state.pp.metrics.inflight["tiny"] == 0
        assert httpx.post(s.url + "/api/embed", json={"model": "tiny", "input": "hi"}).status_code == 200
        assert httpx.post(s.url + "/api/generate", json=body, timeout=60).status_code == 200
    finally:
        s.close()
        reg.close()


# ---- found by fuzzing (tests/server/test_fuzz_http.py) -----------------------------
def _generate(url, **options):
    return httpx.post(url + "/api/generate", timeout=120, json={
        "model": DEFAULT_MODEL_NAME, "prompt": "hi", "stream": False, "options": {"num_predict": 2, **options}})


def test_sampling_extremes_fail_at_most_their_own_request(server):
    # Ollama's seed -1 asks for a random seed. It used to reach numpy on the
    # engine thread, which died: every later request hung.
    assert _generate(server.url, seed=-1).status_code == 200
    r = _generate(server.url, seed=2**70)
    assert r.status_code == 400 and "'seed'" in r.json()["error"]
    # Valid but extreme values overflowed the sampler to NaN probabilities,
    # failing the whole engine step (every request in it) with a 500.
    for options in ({"temperature": 1e-320}, {"temperature": 0.5, "repeat_penalty": 1e-300},
                    {"presence_penalty": -1e308}, {"frequency_penalty": 1e308}):
        r = _generate(server.url, seed=1, **options)
        assert r.status_code == 200 and 1 <= r.json()["eval_count"] <= 2, (options, r.text)  # EOS may end it
    assert wait_pool_empty(server.url)


def test_default_reply_length_stays_within_the_server_limit(registry):
    # The defaults (512, 16) exceeded a smaller --max-tokens, so every request
    # that did not name a length was refused with a 400.
    s = Running(create_app(registry, Limits(max_tokens=3)))
    try:
        r = httpx.post(s.url + "/api/generate", timeout=120,
                       json={"model": DEFAULT_MODEL_NAME, "prompt": "hi", "stream": False})
        assert r.status_code == 200 and r.json()["eval_count"] <= 3
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120,
                       json={"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        r = httpx.post(s.url + "/v1/completions", json={"model": DEFAULT_MODEL_NAME, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # an explicit ask still is
    finally:
        s.close()


@pytest.mark.parametrize("path", ["/api/generate", "/v1/completions"])
def test_unreadable_and_oversized_bodies_get_precise_errors_in_our_shape(server, path):
    def message(r):
        body = r.json()
        return body["error"]["message"] if path.startswith("/v1/") else body["error"]

    # Not UTF-8: was FastAPI's {"detail": "There was an error parsing the body"}.
    r = httpx.post(server.url + path, content=b"\xaf\x82", headers={"content-type": "application/json"})
    assert r.status_code == 400 and message(r).startswith("malformed JSON: the body is not UTF-8")
    # Over the limit without a Content-Length (chunked): was that same 400, not 413.
    r = httpx.post(server.url + path, content=(b"x" * 1024 for _ in range(80)),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 65536 bytes" in message(r)


def test_unknown_routes_and_methods_use_our_error_shape(server):
    r = httpx.get(server.url + "/api/nope")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = httpx.delete(server.url + "/api/generate")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


@pytest.mark.parametrize("path,body,field", [
    ("/api/generate", {"prompt": "hi", "options": {"top_k": True}}, "options.top_k"),
    ("/api/generate", {"prompt": "hi", "options": {"num_ctx": True}}, "options.num_ctx"),
    ("/api/generate", {"prompt": "hi", "stream": "false"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "1"}, "temperature"),
])
def test_request_fields_have_the_types_the_schema_says(server, path, body, field):
    # Lax parsing took true for 1 and "1" for a number, which the schema forbids.
    r = httpx.post(server.url + path, json={"model": DEFAULT_MODEL_NAME, **body})
    assert r.status_code == 400 and field in r.text, r.text


def test_openapi_documents_errors_streams_and_text(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    generate = paths["/api/generate"]["post"]["responses"]
    assert "422" not in generate and "4XX" in generate and "503" in generate
    assert "application/x-ndjson" in generate["200"]["content"]
    assert "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/html" in paths["/dashboard"]["get"]["responses"]["200"]["content"]
