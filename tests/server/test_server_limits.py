"""What one request may ask of the server: each limit a `serve` option, enforced before
any work with a 400 that names it; request fields that used to be 500s; a long chat's
truncation. On a tiny random-weight model, so that every request is cheap."""

import os

import httpx
import pytest

from pyllama_paged.testing.serving import Running, tiny_registry
from pyllama_paged.cli import build_parser, serve_config
from pyllama_paged.calls import chat_call
from pyllama_paged.server.ollama import api as ollama_api
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.engine import MAX_THREADS
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.tools.prompt import render_chat

M = "tiny"
LIMITS = Limits(max_body_bytes=64 * 1024, max_stop=2, max_stop_chars=8, max_tools=1, max_tools_bytes=400,
                max_logit_bias=2, max_messages=3, max_embedding_inputs=2, max_embedding_chars=20,
                max_grammar_bytes=200, max_schema_depth=8)


TINY = True


@pytest.fixture
def work(registry, monkeypatch):
    """How often the routes tokenized, rendered a chat or compiled a format (the work the
    limits come before), counted where the server calls them."""
    served = registry.get(M)
    counts = {"encode": 0, "render": 0, "format": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(served.tokenizer, "encode", counted("encode", served.tokenizer.encode))
    monkeypatch.setattr(served.template, "render", counted("render", served.template.render))
    monkeypatch.setattr(chat_call, "render_chat", counted("render", chat_call.render_chat))
    monkeypatch.setattr(ollama_api, "from_ollama", counted("format", ollama_api.from_ollama))
    return counts


def _message(r) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

OVER_LIMITS = [
    ("/v1/chat/completions", {"messages": USER, "stop": ["a", "b", "c"]}, "--max-stop"),
    ("/api/generate", {"prompt": "hi", "options": {"stop": ["a", "b", "c"]}}, "--max-stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "123456789"}, "--max-stop-chars"),
    ("/api/chat", {"messages": USER, "options": {"stop": ["x" * 9]}}, "--max-stop-chars"),
    ("/api/chat", {"messages": USER, "tools": [TOOL, TOOL]}, "--max-tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "description": "d" * 500}}]}, "--max-tools-bytes"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "--max-logit-bias"),
    ("/v1/chat/completions", {"messages": USER * 4}, "--max-messages"),
    ("/api/chat", {"messages": USER * 4}, "--max-messages"),
    ("/api/embed", {"input": ["a", "b", "c"]}, "--max-embedding-inputs"),
    ("/v1/embeddings", {"input": ["x" * 15, "y" * 15]}, "--max-embedding-chars"),
    ("/v1/embeddings", {"input": [[1] * 21]}, "--max-embedding-chars"),
    ("/api/embeddings", {"prompt": "z" * 21}, "--max-embedding-chars"),
    ("/v1/chat/completions", {"messages": USER, "grammar": 'root ::= "' + "a" * 300 + '"'}, "--max-grammar-bytes"),
    ("/api/generate", {"prompt": "hi", "format": {"enum": ["v" * 50] * 5}}, "--max-grammar-bytes"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _nested(10)}}}, "--max-schema-depth"),
    ("/v1/completions", {"prompt": "hi", "json_schema": _nested(10)}, "--max-schema-depth"),
    ("/api/chat", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": _nested(10)}}]}, "--max-schema-depth"),
]


@pytest.mark.parametrize("path, body, option", OVER_LIMITS, ids=[f"{p} {o}" for p, _, o in OVER_LIMITS])
def test_each_limit_is_a_400_naming_its_option_before_any_work(server, work, path, body, option):
    r = httpx.post(server.url + path, json={"model": M, "stream": False, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert option in _message(r), r.text
    assert work == {"encode": 0, "render": 0, "format": 0}   # refused before tokenizing, rendering, compiling


def test_body_over_the_limit_is_a_413_naming_the_option(server):
    r = httpx.post(server.url + "/api/generate", json={"model": M, "prompt": "x" * 70000})
    assert r.status_code == 413 and "--max-body" in _message(r)


def test_limits_are_serve_options_with_defaults(monkeypatch):
    limits = serve_config(build_parser().parse_args(["serve"])).limits
    assert limits == Limits()
    assert (limits.max_stop, limits.max_tools, limits.max_messages, limits.max_grammar_bytes) == (16, 128, 2048, 65536)
    args = build_parser().parse_args(["serve", "--max-stop", "3", "--max-messages", "9", "--max-grammar-bytes", "5",
                                      "--stats-timeout", "0.5", "--max-prompt-tokens", "100"])
    limits = serve_config(args).limits
    assert (limits.max_stop, limits.max_messages, limits.max_grammar_bytes) == (3, 9, 5)
    assert (limits.stats_timeout, limits.max_prompt_tokens) == (0.5, 100)


def test_default_threads_fit_the_sampler_on_a_big_host(tmp_path, monkeypatch):
    # `serve` on a 128-CPU host asked the native sampler for 128 threads; it takes at most 64
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    options = serve_config(build_parser().parse_args(["serve"])).engine
    assert options.n_threads == MAX_THREADS and ServeConfig.flat().engine.n_threads == MAX_THREADS
    reg = tiny_registry(tmp_path, n_threads=options.n_threads)   # the engine starts with them
    reg.close()
    with pytest.raises(SystemExit, match="--threads"):
        serve_config(build_parser().parse_args(["serve", "--threads", "128"]))


def test_serve_adapts_its_threads_unless_told_how_many(tmp_path):
    # issue 40: beside busy processes a fixed count collapses; a given --threads stays exact
    options = serve_config(build_parser().parse_args(["serve"])).engine
    assert options.adapt_threads
    options = serve_config(build_parser().parse_args(["serve", "--threads", "2"])).engine
    assert not options.adapt_threads and options.n_threads == 2
    reg = tiny_registry(tmp_path, n_threads=2, adapt_threads=True)
    try:
        assert reg.get("tiny").engine_config().adapt_threads
    finally:
        reg.close()


def _naive_truncation(served, messages, n_ctx):
    """Ollama's rule done the slow way: drop the oldest non-system turn until it fits."""
    messages = list(messages)
    while True:
        ids = served.tokenizer.encode(render_chat(served.template, served.tokenizer, messages, None),
                                      add_special=True, parse_special=True)
        droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
        if len(ids) < n_ctx or not droppable:
            return ids
        del messages[droppable[0]]


def test_chat_truncation_drops_what_one_at_a_time_would(server, registry):
    served = registry.get(M)
    messages = [{"role": "system", "content": "be brief"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * (i % 7 + 1)} for i in range(60)]
    s = Running(create_app(registry, Limits(max_messages=100)))
    try:
        for num_ctx in (None, 200):
            options = {"num_predict": 1, **({"num_ctx": num_ctx} if num_ctx else {})}
            r = httpx.post(s.url + "/api/chat", timeout=60, json={"model": M, "messages": messages, "stream": False,
                                                                 "options": options})
            assert r.status_code == 200, r.text
            expected = _naive_truncation(served, messages, num_ctx or served.n_ctx)
            assert r.json()["prompt_eval_count"] == len(expected)
    finally:
        s.close()


def test_a_long_chat_is_truncated_in_few_renders(registry, work):
    # Dropping one turn at a time re-rendered and re-tokenized the whole chat per turn:
    # a few such requests held every worker thread for minutes.
    s = Running(create_app(registry, Limits(max_messages=10_000, max_body_bytes=8 << 20)))
    try:
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(8000)]
        r = httpx.post(s.url + "/api/chat", timeout=60, json={"model": M, "messages": messages, "stream": False,
                                                             "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_eval_count"] < registry.get(M).n_ctx
        assert 1 <= work["render"] <= 16   # bisection over 8000 turns: about log2(8000) + 2
        r = httpx.post(s.url + "/api/chat", timeout=60, json={"model": M, "messages": messages * 2})
        assert r.status_code == 400 and "--max-messages" in _message(r)
    finally:
        s.close()


@pytest.mark.parametrize("keep_alive", ["NaN", "Infinity", "-Infinity", "1e300", '"99999999999999999999h"'])
def test_unusable_keep_alive_is_a_400_and_ps_keeps_answering(server, keep_alive):
    for path, rest in (("/api/generate", '"prompt": "hi", "options": {"num_predict": 1}'),
                       ("/api/embed", '"input": "hi"')):
        r = httpx.post(server.url + path, timeout=60,
                       content='{"model": "tiny", "stream": false, %s, "keep_alive": %s}' % (rest, keep_alive))
        assert r.status_code == 400 and "keep_alive" in _message(r), r.text
        assert httpx.get(server.url + "/api/ps").status_code == 200


def test_ps_survives_a_keep_alive_no_date_can_hold(server, registry):
    served = registry.get(M)
    try:
        for value in (float("nan"), 1e300, float("inf")):
            served.keep_alive = value
            r = httpx.get(server.url + "/api/ps")
            assert r.status_code == 200 and r.json()["models"][0]["expires_at"].startswith("2318")
    finally:
        served.keep_alive = None


@pytest.mark.parametrize("key", ["²", "٣", "1.5", "-1", "１"])
def test_logit_bias_keys_that_are_not_ascii_token_ids_are_400(server, key):
    for path, field in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
        r = httpx.post(server.url + path, json={"model": M, "max_tokens": 1, "logit_bias": {key: 1}, **field})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_header_bytes_beyond_ascii_are_not_a_500(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 1},
                   headers={"x-note": "caf\xe9".encode("latin-1")})
    assert r.status_code == 200, r.text


def test_a_deeply_nested_request_is_a_400(registry):
    # Within what the JSON parser takes, a value nested this deep blew Python's stack
    # (json.loads of OpenAI's arguments text, the schema walk before compiling): a 500.
    s = Running(create_app(registry, Limits(max_schema_depth=100_000)))
    try:
        arguments = '{"a":' * 5000 + "1" + "}" * 5000
        messages = [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}, {"role": "user", "content": "hi"}]
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                       json={"model": M, "max_tokens": 1, "messages": messages})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
        body = '{"model": "tiny", "prompt": "hi", "format": ' + '{"type": "array", "items": ' * 5000 + "{}" + \
               "}" * 5000 + "}"
        r = httpx.post(s.url + "/api/generate", content=body, timeout=60)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text
    finally:
        s.close()
