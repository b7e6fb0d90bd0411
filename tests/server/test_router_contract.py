"""What routers in front of several servers read (server/routing/router_contract.py, the vllm:*
series of server/metrics.py, server/routing/kv_events.py): /health, vLLM's metric names scraped
with prometheus_client's own parser, and the prefix cache's events received on a real ZMQ
SUB socket and decoded with msgpack; then `serve --kv-events --drain-seconds` as a process.
On a tiny model."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pyllama_paged.engine import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pyllama_paged.server.app import create_app  # noqa: E402
from pyllama_paged.server.generation import Limits  # noqa: E402
from pyllama_paged.server.routing.kv_events import KVEventPublisher, KVEventsConfig, encode_batch  # noqa: E402
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model  # noqa: E402
from pyllama_paged.testing.serving import Running, free_port, stop_server, tiny_registry, wait_healthy, wait_until  # noqa: E402

M = "tiny"
LABELS = {"model_name": M, "engine": "0"}


def complete(url, prompt, max_tokens=4):
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": M, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


class Subscriber:
    """A SUB socket bound on loopback (the publisher connects to it), decoding each message."""

    def __init__(self, ctx):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.got: list[tuple[int, list]] = []   # (sequence number, decoded batch)

    def drain(self, timeout_ms=200) -> None:
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))

    def events(self, tag=None) -> list:
        return [e for _, batch in self.got for e in batch[1] if tag is None or e[0] == tag]


@pytest.fixture
def served(tmp_path):
    """A tiny model's server whose engine publishes its cache events, and a subscriber."""
    ctx = zmq.Context()
    sub = Subscriber(ctx)
    replay = f"ipc://{tmp_path}/replay"
    # the subscriber binds loopback here, so the publisher connects (bind=False), and asks for
    # token ids (off by default)
    publisher = KVEventPublisher(KVEventsConfig(endpoint=sub.endpoint, replay_endpoint=replay, bind=False,
                                                token_ids=True))
    # a small pool (kv_budget_tokens of every layer): a few prompts evict earlier ones
    registry = tiny_registry(tmp_path, kv_events=publisher, kv_budget_tokens=256, block_size=16, n_ctx=256)
    server = Running(create_app(registry, Limits()))
    yield server, sub, replay, ctx
    server.close()
    registry.close()
    publisher.close()
    sub.sock.close(linger=0)
    ctx.term()


def test_health_answers_while_the_server_can_serve(tmp_path):
    registry = tiny_registry(tmp_path)
    server = Running(create_app(registry, Limits()))
    try:
        r = httpx.get(server.url + "/health")
        assert r.status_code == 200 and r.content == b""   # vLLM's answer: no body
        assert httpx.head(server.url + "/health").status_code == 200
        state = server.app.state.pp
        state.draining = True
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "draining" in r.json()["error"]
        assert httpx.head(server.url + "/health").status_code == 503
        assert httpx.get(server.url + "/v1/models").status_code == 200   # still serving while it drains
        state.draining = False
        registry.get(M).loop.stop()   # an engine that died cannot take work
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "tiny" in r.json()["error"]
    finally:
        server.close()
        registry.close()


def scrape(url) -> dict:
    """/metrics as prometheus_client reads it: family name -> (type, {sample name: [(labels, value)]})."""
    families = {}
    for f in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        samples = {}
        for s in f.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
        families[f.name] = (f.type, samples)
    return families


def value(families, name, sample=None, **extra):
    _, samples = families[name]
    found = [v for labels, v in samples[sample or name] if labels == {**LABELS, **extra}]
    assert len(found) == 1, (name, samples)
    return found[0]


def test_vllm_metric_names_labels_and_types(served):
    server, *_ = served
    complete(server.url, "a first prompt that fills a block or two of the cache")
    before = scrape(server.url)
    expected = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
                "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
                "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
                "vllm:time_to_first_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram"}
    for name, kind in expected.items():
        assert before[name][0] == kind, name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert value(before, name) == 0
    assert 0 <= value(before, "vllm:kv_cache_usage_perc") <= 1
    assert value(before, "vllm:generation_tokens", "vllm:generation_tokens_total") == 4
    assert value(before, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 1
    assert value(before, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_bucket",
                 le="+Inf") == 1
    assert value(before, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 0
    # our own names stay beside vLLM's
    assert before["pyllama_kv_blocks_free"][0] == "gauge"

    complete(server.url, "a first prompt that fills a block or two of the cache")
    after = scrape(server.url)
    prompt = value(before, "vllm:prompt_tokens", "vllm:prompt_tokens_total")
    assert value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 2 * prompt
    queries = value(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert queries == 2 * value(before, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") > 0
    # the repeated prompt found its full blocks (all but the one holding its last token)
    hits = value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert hits == (prompt - 1) // 16 * 16 > 0
    assert value(after, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2


def chain_ok(stored_events) -> None:
    """Each BlockStored's parent is a hash stored before it (or None at a sequence's start)."""
    seen = set()
    for e in stored_events:
        assert e[2] is None or e[2] in seen, "a parent hash never stored"
        seen |= set(e[1])


def test_kv_events_arrive_chain_evict_and_replay(served):
    server, sub, replay, ctx = served
    tries = iter(range(1000))

    def stored_one():
        # a new prompt each time: the first ones' events may go out before the subscription
        # reaches the publisher (ZMQ's late joiner), and a repeated prompt stores nothing new
        complete(server.url, f"the quick brown fox number {next(tries)} jumps over the lazy dog " * 2)
        sub.drain()
        return sub.events("BlockStored")

    wait_until(stored_one, what="the first BlockStored")
    seqs = [n for n, _ in sub.got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for n, batch in sub.got:
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        for e in events:   # vLLM's tagged arrays
            assert e[0] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
            if e[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium = e
                assert block_size == 16 and len(tokens) == 16 * len(hashes) and lora_id is None and medium == "GPU"
    stored = {h for e in sub.events("BlockStored") for h in e[1]}
    for i in range(8):   # distinct prompts through a pool of 256 tokens: the first one's blocks go
        complete(server.url, f"prompt number {i} is about something else entirely, " * 2)
    wait_until(lambda: sub.drain() is None and stored <= {h for e in sub.events("BlockRemoved") for h in e[1]},
               what="the first prompt's blocks removed")
    seqs = [n for n, _ in sub.got]
    assert seqs == list(range(seqs[0], seqs[-1] + 1))   # no gap: nothing dropped on the way
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    wait_until(lambda: sub.drain() is None and sub.events("AllBlocksCleared"), what="AllBlocksCleared")

    # replay: what the subscriber missed before it was connected (the load's AllBlocksCleared
    # at 0) and everything since, with the same numbers and payloads, then the end marker
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(10_000)
        _, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    dealer.close(linger=0)
    assert replayed[0][0] == 0 and replayed[0][1][1] == [["AllBlocksCleared"]]
    chain_ok([e for _, batch in replayed for e in batch[1] if e[0] == "BlockStored"])
    assert [n for n, _ in replayed] == list(range(len(replayed)))
    live = dict(sub.got)
    assert all(live[n] == batch for n, batch in replayed if n in live) and set(live) <= {n for n, _ in replayed}


def test_map_encoding_is_vllm_after_positional_events():
    events = [BlockStored([11, 12], 7, list(range(8)), 4), BlockRemoved([7]), AllBlocksCleared()]
    ts, records, rank = msgpack.unpackb(encode_batch(1.5, events, "map", token_ids=True))
    assert (ts, rank) == (1.5, 0)
    assert records == [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 7, "token_ids": list(range(8)),
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"}]
    assert msgpack.unpackb(encode_batch(1.5, events, token_ids=True))[1] == [
        ["BlockStored", [11, 12], 7, list(range(8)), 4, None, "GPU"], ["BlockRemoved", [7], "GPU"],
        ["AllBlocksCleared"]]
    # by default the hashes go out without the tokens: vLLM's shape, an empty list
    assert msgpack.unpackb(encode_batch(1.5, events))[1][0] == ["BlockStored", [11, 12], 7, [], 4, None, "GPU"]
    assert msgpack.unpackb(encode_batch(1.5, events, "map"))[1][0]["token_ids"] == []
    big = 2 ** 64 - 1   # our hashes are unsigned 64-bit, as vLLM's are
    assert msgpack.unpackb(encode_batch(0.0, [BlockRemoved([big])]))[1] == [["BlockRemoved", [big], "GPU"]]


def test_a_full_queue_drops_instead_of_blocking(tmp_path):
    publisher = KVEventPublisher(KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", max_queue_size=1))
    try:
        publisher._abandon = True   # the sender stops taking from the queue
        publisher._thread.join(5)
        started = time.perf_counter()
        for _ in range(100):
            publisher.kv_events([AllBlocksCleared()])
        assert time.perf_counter() - started < 1 and publisher.dropped == 99
    finally:
        publisher.close()


def test_serve_publishes_and_drains_before_it_stops(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", "gemma3", weight_type="q8_0")
    port = free_port()
    events = f"ipc://{tmp_path}/events"   # an ipc endpoint is bound by the server, as tcp://*:N is
    cmd = [sys.executable, "-m", "pyllama_paged.cli", "serve", "--model", str(model), "--port", str(port),
           "--threads", "2", "--kv-budget", "2048", "--kv-events", events, "--drain-seconds", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/",
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "/health", timeout=120)
        sub.connect(events)
        got = []

        def stored():
            complete(url, "a prompt long enough to fill a block of thirty-two tokens, " * 3)
            while sub.poll(300):
                got.append(msgpack.unpackb(sub.recv_multipart()[2]))
            return any(e[0] == "BlockStored" for b in got for e in b[1])

        wait_until(stored, timeout=60, what="BlockStored from the served engine")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(url + "/health").status_code == 503, what="draining")
        assert httpx.get(url + "/v1/models").status_code == 200   # still serving meanwhile
        assert proc.wait(30) == 0
        while sub.poll(2000):   # the engine closed: its cache is gone, and the server says so
            got.append(msgpack.unpackb(sub.recv_multipart()[2]))
        assert got[-1][1] == [["AllBlocksCleared"]]
    finally:
        stop_server(proc)
        sub.close(linger=0)
        ctx.term()
