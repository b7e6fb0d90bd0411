"""KV events tried as someone who should not read them would (server/routing/kv_events.py): the
default endpoint is bound on loopback (an IPv4 loopback address used to be connected to,
never bound), a wildcard bind is logged as a warning, a subscriber sees no token ids
unless the operator asked for them, a replay of the whole buffer neither holds live
events back nor loses batches to a slow reader, and a client hammering the replay socket
gets one replay at a time. Real ZMQ sockets, a real server on a tiny model."""

import logging
import socket

import httpx
import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from pyllama_paged.engine import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pyllama_paged.server.app import create_app  # noqa: E402
from pyllama_paged.server.generation import Limits  # noqa: E402
from pyllama_paged.server.routing import kv_events  # noqa: E402
from pyllama_paged.server.routing.kv_events import END_OF_REPLAY, KVEventPublisher, KVEventsConfig  # noqa: E402
from pyllama_paged.testing.serving import Running, free_port, tiny_registry, wait_until  # noqa: E402


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _sub(ctx, endpoint):
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _joined(publisher, sub):
    """Publish markers until the subscriber gets one (ZMQ's late joiner); the batches read."""
    got = []

    def arrived():
        publisher.kv_events([AllBlocksCleared()])
        while sub.poll(50):
            got.append(sub.recv_multipart())
        return bool(got)

    wait_until(arrived, what="the subscription")
    return got


def _receive_until(sub, seq_wanted, got=None):
    """Read the SUB socket until batch seq_wanted arrives; every (seq, payload) read."""
    got = [] if got is None else got
    while not got or got[-1][0] < seq_wanted:
        assert sub.poll(10_000), f"batch {seq_wanted} never arrived"
        _, seq, payload = sub.recv_multipart()
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def test_the_default_endpoint_is_loopback_and_bound(ctx, caplog):
    """With no address given the events stay on this machine; and a loopback address is
    bound (vLLM's rule connected to it, so nobody could listen on loopback alone)."""
    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    caplog.set_level(logging.INFO, logger="pyllama_paged.server")
    publisher = KVEventPublisher(KVEventsConfig(endpoint=endpoint))
    sub = _sub(ctx, endpoint)   # connects: only a bound publisher is reachable
    try:
        _joined(publisher, sub)
    finally:
        publisher.close()
        sub.close(linger=0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "pyllama_paged.server"]
    binds = kv_events.binds
    assert binds("tcp://localhost:5557") and binds("tcp://[::1]:5557") and binds("tcp://0.0.0.0:5557")
    assert not binds("tcp://router.internal:5557") and binds("tcp://10.0.0.7:5557", bind=True)
    assert not binds("tcp://127.0.0.1:5557", bind=False)   # a router listening on loopback


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback_binds(ctx):
    endpoint = f"tcp://[::1]:{free_port()}"
    publisher = KVEventPublisher(KVEventsConfig(endpoint=endpoint))
    sub = ctx.socket(zmq.SUB)
    sub.ipv6 = True
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        _joined(publisher, sub)
    finally:
        publisher.close()
        sub.close(linger=0)


def test_a_wildcard_bind_is_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="pyllama_paged.server")
    for endpoint, token_ids in ((f"tcp://*:{free_port()}", False), (f"tcp://0.0.0.0:{free_port()}", True)):
        caplog.clear()
        publisher = KVEventPublisher(KVEventsConfig(endpoint=endpoint, token_ids=token_ids))
        publisher.close()
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name == "pyllama_paged.server"]
        assert len(warnings) == 1 and "every interface" in warnings[0], warnings
        assert ("token ids" in warnings[0]) and (("every prompt" in warnings[0]) == token_ids)


def test_a_subscriber_reads_no_prompt_unless_asked(tmp_path, ctx):
    """A subscriber on the events socket while a user, with the API key, sends a prompt:
    by default it learns which hashes are cached, never the tokens."""
    endpoint = f"ipc://{tmp_path}/events"
    seen = {}
    for token_ids in (False, True):
        (tmp_path / str(token_ids)).mkdir()
        publisher = KVEventPublisher(KVEventsConfig(endpoint=endpoint + str(token_ids), token_ids=token_ids))
        registry = tiny_registry(tmp_path / str(token_ids), kv_events=publisher, block_size=16, n_ctx=256)
        server = Running(create_app(registry, Limits(), api_key="secret-key"))
        sub = _sub(ctx, endpoint + str(token_ids))
        stored = []
        tries = iter(range(1000))

        def some_stored():
            r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"Authorization": "Bearer secret-key"},
                           json={"model": "tiny", "prompt": f"my bank password is hunter{next(tries)} " * 6,
                                 "max_tokens": 2, "temperature": 0})
            r.raise_for_status()
            while sub.poll(200):
                batch = msgpack.unpackb(sub.recv_multipart()[2])
                stored.extend(e for e in batch[1] if e[0] == "BlockStored")
            return bool(stored)

        try:
            wait_until(some_stored, what="a BlockStored")
        finally:
            server.close()
            registry.close()
            publisher.close()
            sub.close(linger=0)
        seen[token_ids] = stored
    assert all(e[1] and e[3] == [] for e in seen[False])
    assert all(len(e[3]) == 16 * len(e[1]) for e in seen[True])


def _stored(i, n_tokens=512):
    return [BlockStored([i], None, list(range(n_tokens)), n_tokens)]


def _replay_dealer(ctx, endpoint, rcvhwm=10):
    dealer = ctx.socket(zmq.DEALER)
    dealer.rcvhwm = rcvhwm   # a slow reader: it takes what it is sent only as it reads
    dealer.connect(endpoint)
    return dealer


def _read_replay(dealer):
    """Every (seq, payload) of one replay up to its end marker."""
    out = []
    while True:
        assert dealer.poll(20_000), "the replay stopped before its end"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_OF_REPLAY:
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def test_a_replay_of_the_whole_buffer_interleaves_with_live_events(tmp_path, ctx):
    """A slow client asks for the last 10,000 batches: a live batch published after its
    request goes out while the replay is far from done, and the client, reading at its
    own pace, still gets all 10,000, in order, none dropped."""
    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                            token_ids=True, buffer_steps=10_000)
    publisher = KVEventPublisher(config)
    sub = _sub(ctx, config.endpoint)
    dealer = _replay_dealer(ctx, config.replay_endpoint)
    try:
        got = [(int.from_bytes(f[1], "big"), f[2]) for f in _joined(publisher, sub)]
        for i in range(10_000):   # ~1.5 KiB each: far more than socket buffers hold
            publisher.kv_events(_stored(i))
        last = got[-1][0] + 10_000
        _receive_until(sub, last, got)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(20_000)
        first = dealer.recv_multipart()
        # live, while the replay waits on its slow reader
        publisher.kv_events([BlockRemoved([424242])])
        live = _receive_until(sub, last + 1)
        assert msgpack.unpackb(live[-1][1])[1] == [["BlockRemoved", [424242], "GPU"]]
        served_when_live_went = getattr(publisher, "replays_served", None)
        replayed = [(int.from_bytes(first[1], "big"), first[2])] + _read_replay(dealer)
        assert [n for n, _ in replayed] == list(range(last - 9_999, last + 1))
        assert dict(replayed) == {n: p for n, p in got if n in dict(replayed)}
        assert msgpack.unpackb(replayed[-1][1])[1][0][1] == [9_999]
        assert served_when_live_went == 0   # the replay was far from done
        assert publisher.replays_served == 1 and publisher.replays_abandoned == 0
    finally:
        publisher.close()
        sub.close(linger=0)
        dealer.close(linger=0)


def test_a_client_hammering_replay_gets_one_at_a_time(tmp_path, ctx):
    """One client sends 200 replay requests at once, five others one each: the first
    client gets one replay, the others share the few places, the rest get no answer, and
    live events go on meanwhile."""
    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                            token_ids=True, buffer_steps=4_000, replay_max_clients=4)
    publisher = KVEventPublisher(config)
    sub = _sub(ctx, config.endpoint)
    dealers = [_replay_dealer(ctx, config.replay_endpoint) for _ in range(6)]
    try:
        got = [(int.from_bytes(f[1], "big"), f[2]) for f in _joined(publisher, sub)]
        for i in range(2_000):
            publisher.kv_events(_stored(i))
        last = got[-1][0] + 2_000
        _receive_until(sub, last, got)
        hammer, others = dealers[0], dealers[1:]
        for _ in range(200):
            hammer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert hammer.poll(20_000)   # its first request is being answered
        for d in others:
            d.send_multipart([b"", (0).to_bytes(8, "big")])
        publisher.kv_events([BlockRemoved([7])])
        _receive_until(sub, last + 1)   # live events are not held up
        wait_until(lambda: sum(bool(d.poll(0)) for d in others) >= 3, what="the other replays")
        everything = list(range(last + 1))   # all buffered when they asked: none left the buffer
        assert [n for n, _ in _read_replay(hammer)] == everything
        assert not hammer.poll(500)   # one replay for 200 requests
        answered = [d for d in others if d.poll(0)]
        assert len(answered) == 3
        for d in answered:
            assert [n for n, _ in _read_replay(d)] == everything
        assert not any(d.poll(0) for d in others)
        assert publisher.replays_served == 4 and publisher.replays_refused == 199 + 2
    finally:
        publisher.close()
        sub.close(linger=0)
        for d in dealers:
            d.close(linger=0)
