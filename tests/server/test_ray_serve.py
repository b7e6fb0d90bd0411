"""Replicas on Ray Serve (server/scale_out/ray_app.py, server/scale_out/ray_routing.py), on real parts: a Ray
cluster of a head and a worker node started here (one CPU each, on this machine),
`pyllama-paged serve --ray` deploying two replicas of the default model, the `openai`
and `ollama` clients through Serve's HTTP proxy, and a replica's process killed mid-stream.

The cluster tests are slow (a cluster, two model loads, a replica restarted): `-m slow`."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pyllama-paged[ray]')")

import ollama  # noqa: E402
import openai  # noqa: E402

from pyllama_paged.api.llama import Llama  # noqa: E402
from pyllama_paged.cli import build_parser, serve_config  # noqa: E402
from pyllama_paged.server.scale_out.ray_app import build, build_config  # noqa: E402
from pyllama_paged.server.scale_out.ray_routing import PIN_HEADER, rendezvous_order, routing_text  # noqa: E402
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits  # noqa: E402
from pyllama_paged.testing.ray_cluster import (RayCluster, start_ray_server, stop_ray_server,  # noqa: E402
                                               wait_replicas)

MODEL = "gemma3:270m-base"
CTX = 1024


@pytest.fixture(scope="module")
def cluster():
    with RayCluster(workers=1, cpus=1) as c:
        yield c


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray-serve") / "serve.log"
    # one thread and one Ray CPU per replica: one replica on each node
    proc, url = start_ray_server(cluster, ["--replicas", "2", "--threads", "1", "--ctx", str(CTX),
                                           "--kv-budget", "8192", "--max-seqs", "8"], log)
    yield proc, url
    stop_ray_server(proc)


@pytest.fixture(scope="module")
def url(server):
    return server[1]


@pytest.fixture(scope="module")
def local():
    """The same model in this process, as the replicas run it (one thread, same context)."""
    with Llama(n_ctx=CTX, n_threads=1) as llm:
        yield llm


def replicas(url) -> dict[str, dict]:
    return {r["replica"]: r for r in httpx.get(url + "/ray/replicas", timeout=60).json()["replicas"]}


def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)


@pytest.mark.slow
def test_two_replicas_on_two_nodes(url):
    found = replicas(url)
    assert len(found) == 2
    assert len({r["node"] for r in found.values()}) == 2   # one CPU per node, one per replica
    assert all(r["healthy"] and r["models"][MODEL] is not None for r in found.values())


@pytest.mark.slow
def test_replica_listing_is_refused_to_rebound_names_and_other_sites(url):
    # the ingress answers /ray/replicas itself (ids, nodes, pids, hosts): the replicas' Host
    # and Origin checks must hold there too (issue 39)
    rebound = httpx.get(url + "/ray/replicas", headers={"Host": "attacker.example"}, timeout=60)
    assert rebound.status_code == 403 and "not allowed" in rebound.text and "pid" not in rebound.text
    page = httpx.get(url + "/ray/replicas", headers={"Origin": "http://attacker.example"}, timeout=60)
    assert page.status_code == 403 and "pid" not in page.text
    assert httpx.get(url + "/ray/replicas", timeout=60).status_code == 200


@pytest.mark.slow
def test_answers_match_a_local_llama(url, local):
    # Ollama's client: the answer's token ids (context) against this process's greedy ones
    # for the same prompt ids, up to a near-tie (pyllama_paged/testing/agreement.py)
    got = ollama.Client(host=url, timeout=300).generate(
        model=MODEL, prompt="Name three colours of the rainbow.",
        options={"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0})
    n_prompt = got["prompt_eval_count"]
    prompt, answer = list(got["context"][:n_prompt]), list(got["context"][n_prompt:])
    assert answer
    expected = list(itertools.islice(local.generate(prompt, temp=0.0), len(answer)))
    assert_greedy_agree(prompt, expected, answer, engine_logits(local.runner), local.llm_engine.eot_ids)

    # OpenAI's client: the chat answer (same template, a single sequence on both sides)
    messages = [{"role": "user", "content": "What is the capital of Italy? One word."}]
    served = client(url).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    mine = local.create_chat_completion(messages, temperature=0, max_tokens=8)
    assert served.choices[0].message.content == mine["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_streams_pass_through_the_proxy(url):
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    stream = client(url).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and stream.response.headers[PIN_HEADER]
    whole = client(url).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                                extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].message.content

    parts = list(ollama.Client(host=url, timeout=300).chat(
        model=MODEL, messages=messages, stream=True, options={"temperature": 0, "num_predict": 16}))
    assert len(parts) > 2 and parts[-1]["done"]
    assert "".join(p["message"]["content"] for p in parts) == whole.choices[0].message.content


def system_prompt(library: str) -> str:
    """A system prompt longer than the routing prefix (1024 characters) and than a few KV pages."""
    return f"You are the help desk of the {library} public library. " + " ".join(
        f"Rule {i}: answer questions about opening hours, loans, renewals, fines and the reading room "
        f"politely, and say which desk handles case number {i}." for i in range(14))


def routing_key(system: str) -> str:
    """What the ingress hashes for a chat with this system prompt (its first 1024 characters)."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}]}
    return routing_text(httpx.Request("POST", "/", json=body).content, 1024)


@pytest.mark.slow
def test_requests_sharing_a_prefix_land_on_one_replica(url):
    before = replicas(url)
    assert len(before) == 2
    # a system prompt that rendezvous hashing sends to each replica; replica names are random
    # per run, so a fixed handful of prompts can all hash to one of them (1 run in 64 with 7):
    # keep naming libraries until both replicas have one
    homes: dict[str, str] = {}
    for branch in range(200):
        system = system_prompt(f"Branch {branch}")
        homes.setdefault(rendezvous_order(routing_key(system), list(before))[0], system)
        if len(homes) == 2:
            break
    assert len(homes) == 2
    landed: dict[str, list[str]] = {home: [] for home in homes}
    for question in ("When do you open on Sundays?", "How do I renew a book?", "Where is the reading room?",
                     "What is the fine for a late DVD?"):
        for home, system in homes.items():
            raw = client(url).chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=4, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            landed[home].append(raw.headers[PIN_HEADER])
            assert raw.parse().choices[0].message.content is not None
    assert all(set(where) == {home} for home, where in landed.items()), landed
    after = replicas(url)
    for home, system in homes.items():
        hits = after[home]["models"][MODEL]["prefix_cache_hits"] - before[home]["models"][MODEL]["prefix_cache_hits"]
        # the last three requests of each found their system prompt's pages cached (a
        # token is at most ~8 characters of this text; whole 32-token pages are shared)
        assert hits >= 3 * (len(system) // 8 // 32) * 32 > 0


@pytest.mark.slow
def test_the_pin_header_picks_the_replica(url):
    for replica in replicas(url):
        r = httpx.get(url + "/api/pool", headers={PIN_HEADER: replica}, timeout=60)
        assert r.status_code == 200 and r.headers[PIN_HEADER] == replica


@pytest.mark.slow
def test_a_client_that_hangs_up_frees_its_pages_on_the_replica(url):
    replica = sorted(replicas(url))[0]
    generated_before = replicas(url)[replica]["models"][MODEL]["generated_tokens"]
    body = {"model": MODEL, "prompt": "Write a long story about a lighthouse keeper.", "stream": True,
            "options": {"num_predict": 400}}
    with httpx.stream("POST", url + "/api/generate", json=body, headers={PIN_HEADER: replica}, timeout=300) as r:
        assert next(r.iter_lines())   # generating on that replica
    # the proxy cancels the ingress's call, Serve cancels the replica's, and the app sees
    # the client gone: the request is aborted long before its 400 tokens
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pool = httpx.get(url + "/api/pool", headers={PIN_HEADER: replica}, timeout=60).json()
        if pool["stats"]["blocks_used"] == 0:
            break
        time.sleep(0.5)
    assert pool["stats"]["blocks_used"] == 0
    assert replicas(url)[replica]["models"][MODEL]["generated_tokens"] - generated_before < 200


@pytest.mark.slow
def test_a_replica_killed_mid_stream_fails_only_its_own_requests(url):
    found = replicas(url)
    doomed, survivor = sorted(found)
    oai = client(url)

    def start(replica: str, question: str):
        stream = oai.chat.completions.create(
            model=MODEL, max_tokens=120, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": question}], extra_body={"ignore_eos": True},
            extra_headers={PIN_HEADER: replica})
        chunks = iter(stream)
        assert next(chunks) is not None   # streaming has begun on that replica
        assert stream.response.headers[PIN_HEADER] == replica
        return chunks

    dying = start(doomed, "Write a long story about a lighthouse keeper.")
    living = start(survivor, "Write a long story about a mountain village.")
    os.kill(found[doomed]["pid"], signal.SIGKILL)   # the replica's worker process, as a crash would
    with pytest.raises(openai.APIError, match="replica"):
        for _ in dying:
            pass
    usage = [c.usage for c in living if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 120   # the other replica's stream ran to its end

    # the next requests, whatever their prefix, go to a live replica (the one that is left, or
    # a replacement if Serve is that quick)
    for question in ("Write a long story about a lighthouse keeper.", "Hello there."):
        raw = oai.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": question}])
        assert raw.status_code == 200 and raw.headers[PIN_HEADER] != doomed
    # Serve replaces the dead replica
    assert survivor in {r["replica"] for r in wait_replicas(url, 2, timeout=600)}


@pytest.mark.slow
def test_stopping_drains_requests_in_flight(server):
    # last: it stops the server. Ctrl-C deletes the application; the replica finishes the
    # stream it is serving before it goes
    proc, url = server
    wait_replicas(url, 2, timeout=600)
    parts = ollama.Client(host=url, timeout=300).generate(
        model=MODEL, prompt="Tell me about the history of bridges.", stream=True,
        options={"temperature": 0, "num_predict": 40, "repeat_penalty": 1.0})
    first = next(parts)
    assert not first["done"]
    stopped = {}
    stopper = threading.Thread(target=lambda: stopped.update(rc=stop_ray_server(proc)))
    stopper.start()
    rest = list(parts)
    stopper.join()
    assert rest[-1]["done"] and not any("error" in p for p in rest)
    assert stopped["rc"] == 0


def key_of(body: dict, chars: int = 1024) -> str:
    return routing_text(json.dumps(body).encode(), chars)


def test_the_routing_key_is_what_each_api_reads_first():
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert key_of(chat) == "m\nBe brief.Hi"
    # a conversation's later turns key as its first: they go where its pages are
    later = {"model": "m", "messages": chat["messages"] + [{"role": "assistant", "content": "Hello"},
                                                          {"role": "user", "content": "More"}]}
    assert key_of(later) == key_of(chat)
    no_system = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]
    assert key_of({"model": "m", "messages": no_system}) == "m\nHi"
    # Anthropic: the system prompt beside the messages, contents as parts
    assert key_of({"model": "m", "system": [{"type": "text", "text": "Sys."}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]}]}) == "m\nSys.Q"
    # Ollama's generate: system, then prompt; OpenAI's completions: a list of prompts
    assert key_of({"model": "m", "system": "S", "prompt": "P"}) == "m\nSP"
    assert key_of({"model": "m", "prompt": ["a", "b"]}) == "m\nab"
    # the Responses API: instructions, then input
    assert key_of({"model": "m", "instructions": "I", "input": "x"}) == "m\nIx"
    assert key_of({"model": "m", "prompt": "x" * 5000}, 100) == "m\n" + "x" * 100
    # nothing to route by: any replica (the least loaded)
    assert key_of({"model": "m"}) == "" and routing_text(b"not json", 100) == "" and routing_text(b"[1]", 100) == ""


def test_only_the_keys_of_a_replica_that_leaves_move():
    keys = [f"app {i}" for i in range(400)]
    before = {k: rendezvous_order(k, ["a", "b", "c", "d"])[0] for k in keys}
    assert set(before.values()) == {"a", "b", "c", "d"}
    after = {k: rendezvous_order(k, ["a", "b", "d"])[0] for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == "c" for k in moved)


def test_builder_arguments_as_serve_run_passes_them():
    config = build_config({"replicas": "3", "replica_cpus": "2", "replica_memory": "1000", "router": "round_robin",
                           "models": "a.gguf,b.gguf", "engine": {"n_ctx": 512}, "limits": {"max_tokens": 64}})
    scale = config.scale_out
    assert (scale.replicas, scale.replica_cpus, scale.replica_memory, scale.router) == (3, 2.0, 1000, "round_robin")
    assert config.engine.n_ctx == 512 and config.engine.n_threads == 2 and config.limits.max_tokens == 64
    assert config.models == ["a.gguf", "b.gguf"]
    with pytest.raises(ValueError, match="replcas"):
        build_config({"replcas": 2})
    assert build({"replicas": 1}) is not None   # an application, ready for serve.run


def test_serve_takes_the_ray_options():
    scale = serve_config(build_parser().parse_args(["serve", "--ray", "auto", "--replicas", "3", "--replica-memory",
                                                    "2GiB", "--ray-router", "round_robin"])).scale_out
    assert (scale.address, scale.replicas, scale.replica_memory, scale.router) == ("auto", 3, 2 * 2**30, "round_robin")


def test_ray_stays_optional():
    # importing the package, its server and CLI never imports Ray (only `serve --ray` does)
    code = ("import sys, pyllama_paged, pyllama_paged.cli, pyllama_paged.server.app; "
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, timeout=120).returncode == 0
