"""What a new user's first hour met on the server (issues 40 and 54): Ollama's /api/chat with
tools and a plain-text answer through the unmodified `ollama` client, streamed and not;
llama-server's OpenAI paths without /v1 (dspy's Ollama provider posts to /chat/completions);
the embedded chat model answering in sentences and the base model under its own name; an
unset answer length on a model without a chat template cut where `run` cuts it; against a
real server on the embedded models."""

import re

import httpx
import ollama
import openai
import pytest

from pyllama_paged.calls.sampling_options import BASE_MODEL_MAX_TOKENS
from pyllama_paged.models.embedded import (CHAT_MODEL_INSTALL, CHAT_MODEL_NAME, OLLAMA_GEMMA3_270M,
                                           chat_model_missing, chat_model_path)
from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.testing.serving import Running, default_model_server, tiny_registry, wait_pool_empty

M = DEFAULT_MODEL_NAME

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with default_model_server(Limits(max_tokens=64), n_ctx=512, n_threads=2, n_batch=128, block_size=32,
                              kv_budget_tokens=4096, max_num_seqs=8) as s:
        yield s


def test_ollama_chat_with_tools_keeps_a_plain_answer(server):
    client = ollama.Client(host=server.url)
    messages = [{"role": "user", "content": "Write a sentence about the sea."}]
    options = {"temperature": 0, "num_predict": 24, "seed": 7}
    # the tools are offered but the (base) model answers in prose: that prose is the content
    whole = client.chat(model=M, messages=messages, tools=[WEATHER_TOOL], stream=False, options=options)
    assert not whole.message.tool_calls
    assert whole.message.content.strip(), "a plain-text answer came back empty"
    pieces = list(client.chat(model=M, messages=messages, tools=[WEATHER_TOOL], stream=True, options=options))
    streamed = "".join(p.message.content or "" for p in pieces)
    assert pieces[-1].done and not any(p.message.tool_calls for p in pieces)
    assert streamed == whole.message.content   # one request each, greedy: the same answer
    # and what OpenAI's route answers to the same chat
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(model=M, messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                    max_tokens=24, seed=7)
    assert r.choices[0].message.content == whole.message.content
    assert wait_pool_empty(server.url)


def test_ollama_chat_with_tools_still_returns_calls(server):
    # a format shaped like the call makes the base model write one: it must come back as a call
    call_format = {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"const": "get_weather"}, "arguments": {
            "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}}}}}
    client = ollama.Client(host=server.url)
    for stream in (False, True):
        r = client.chat(model=M, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                        format=call_format, stream=stream, options={"temperature": 0, "num_predict": 40})
        parts = list(r) if stream else [r]
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
        assert [c.function.name for c in calls] == ["get_weather"], stream
        assert isinstance(calls[0].function.arguments["city"], str)
        assert not "".join(p.message.content or "" for p in parts).strip()


def test_openai_paths_without_v1(server):
    # llama-server serves its OpenAI routes with and without /v1; dspy and others post to the bare path
    bare = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    chat = bare.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason in ("stop", "length")
    text = bare.completions.create(model=M, prompt="Once upon a time", max_tokens=4)
    assert text.object == "text_completion" and text.choices[0].text
    chunks = list(bare.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    vectors = bare.embeddings.create(model=M, input=["a cat", "a dog"])
    assert [len(d.embedding) for d in vectors.data] == [640, 640]
    assert M in [m.id for m in bare.models.list()]
    assert bare.models.retrieve(M).id == M
    # the /v1 routes are unchanged, and errors on the bare paths keep OpenAI's shape
    versioned = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert versioned.embeddings.create(model=M, input="a cat").data[0].embedding == \
        bare.embeddings.create(model=M, input="a cat").data[0].embedding
    with pytest.raises(openai.NotFoundError):
        bare.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    r = httpx.post(f"{server.url}/chat/completions", timeout=30,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # the bare paths are aliases: the documented schema lists the /v1 ones only
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths
    assert wait_pool_empty(server.url)


# ---- the embedded chat model (issue 54) ----------------------------------------
# words nearly every English sentence holds one of: a sentence of English words holds some
COMMON_WORDS = {"the", "a", "an", "is", "are", "was", "of", "and", "to", "in", "it", "i", "i'm", "you", "with",
                "for", "on", "that", "this", "be", "by", "as", "at", "or", "my", "me", "we", "can", "what", "which"}


def english_sentences(text: str) -> list[str]:
    """The sentences of text made of English words: a capital first, four words or more,
    every word letters (an apostrophe or hyphen inside), two of them common English words,
    then a full stop, question or exclamation mark."""
    found = []
    for sentence in re.findall(r"[A-Z][^.!?]*[.!?]", text):
        words = re.findall(r"[^\s,;:()\"]+", sentence[:-1])
        if (len(words) >= 4 and all(re.fullmatch(r"[A-Za-z]+(?:['-][A-Za-z]+)*", w) for w in words)
                and sum(w.lower() in COMMON_WORDS for w in words) >= 2):
            found.append(sentence)
    return found


def test_english_sentences_tells_prose_from_rambling():
    assert english_sentences("Hello! I'm here to help with any kind of writing project. What") == [
        "I'm here to help with any kind of writing project."]
    assert not english_sentences("L'Étoile, la Marseillaise, la femme au martyre.")
    assert not english_sentences("the sky is blue and")   # no capital, no end
    assert not english_sentences("1, 2, 3, 4, 5.")


def test_ollama_client_chats_with_the_embedded_chat_model(server):
    if chat_model_path() is None:
        pytest.skip(chat_model_missing())
    client = ollama.Client(host=server.url)
    assert [m.model for m in client.list().models] == [DEFAULT_MODEL_NAME, CHAT_MODEL_NAME]
    assert CHAT_MODEL_NAME not in [m.model for m in client.ps().models]   # offered; loaded on first use
    r = client.chat(model=CHAT_MODEL_NAME, messages=[{"role": "user", "content": "Hello! Who are you?"}],
                    options={"temperature": 0, "num_predict": 32})
    assert r.done and r.eval_count <= 32
    assert english_sentences(r.message.content), r.message.content
    assert CHAT_MODEL_NAME in [m.model for m in client.ps().models]
    assert client.show(CHAT_MODEL_NAME).details.family == "llama"
    # the OpenAI client reaches the same model by the same name
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert CHAT_MODEL_NAME in [m.id for m in oai.models.list()]
    assert wait_pool_empty(server.url)


def test_gemma3_270m_means_ollamas_instruct_model_not_the_base(server):
    # the embedded base model has its own name; gemma3:270m is what `pull gemma3:270m` fetches
    client = ollama.Client(host=server.url)
    assert client.show(DEFAULT_MODEL_NAME).details.family == "gemma3"
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=OLLAMA_GEMMA3_270M, prompt="hi", options={"num_predict": 1})
    assert e.value.status_code == 404
    assert "pyllama-paged pull gemma3:270m" in str(e.value) and DEFAULT_MODEL_NAME in str(e.value)


def test_the_chat_models_name_says_how_to_install_it(tmp_path):
    # a server without it (started with files) answers a request for it with the pip command
    registry = tiny_registry(tmp_path)
    server = Running(create_app(registry))
    try:
        r = httpx.post(f"{server.url}/api/chat", json={"model": CHAT_MODEL_NAME, "messages": []}, timeout=30)
        assert r.status_code == 404
        if chat_model_path() is None:
            assert CHAT_MODEL_INSTALL in r.json()["error"]
    finally:
        server.close()
        registry.close()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_an_unset_limit_on_a_model_without_a_template_stops_where_run_stops(tmp_path, route):
    # a base model (the tiny one has no chat template) would ramble to the server's cap of 4096
    registry = tiny_registry(tmp_path, n_ctx=1024)
    assert not registry.get("tiny").has_chat_template
    server = Running(create_app(registry, Limits()))
    try:
        body = {"model": "tiny", "ignore_eos": True, "temperature": 0}
        if route == "/v1/responses":
            r = httpx.post(server.url + route, json={**body, "input": "Once upon a time"}, timeout=120).json()
            assert r["usage"]["output_tokens"] == BASE_MODEL_MAX_TOKENS, r
            given = httpx.post(server.url + route, json={**body, "input": "Hi", "max_output_tokens": 200},
                               timeout=120).json()
            assert given["usage"]["output_tokens"] == 200
        else:
            messages = [{"role": "user", "content": "Once upon a time"}]
            r = httpx.post(server.url + route, json={**body, "messages": messages}, timeout=120).json()
            assert r["usage"]["completion_tokens"] == BASE_MODEL_MAX_TOKENS and \
                r["choices"][0]["finish_reason"] == "length"
            given = httpx.post(server.url + route, json={**body, "messages": messages, "max_tokens": 200},
                               timeout=120).json()
            assert given["usage"]["completion_tokens"] == 200   # a limit asked for is kept
    finally:
        server.close()
        registry.close()
