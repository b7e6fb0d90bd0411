"""KV-cache events on a ZMQ PUB socket, in vLLM's wire format, for routers that send
each prompt where its prefix is cached (`serve --kv-events`, bound on
tcp://127.0.0.1:5557 unless told otherwise).

The events are as sensitive as the prompts: with token ids on (`token_ids=True`)
every BlockStored carries the prompt's tokens, and the socket has no authentication
(the API key does not cover it). So the default endpoint is loopback, token ids are
off unless asked for (BlockStored then carries an empty token list: vLLM's shape,
hashes only), and binding a wildcard or another interface is logged as a warning at
startup (docs/scale-out.md, "KV-cache events").

Each message is three frames: the topic, a sequence number (8 bytes, big-endian) and a
msgpack batch [ts, events, data_parallel_rank]. An event is a tagged array
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
["BlockRemoved", block_hashes, medium] or ["AllBlocksCleared"] (vLLM before its map
encoding), or with `format="map"` a map with the tag under "type" and the fields by name
(vLLM since it dropped positional events). A ROUTER socket (the replay endpoint) answers a
request [empty frame, 8-byte start sequence number] with every batch still buffered from
that number up to the newest at the time of the request, as [empty, seq, payload]
messages, then [empty, -1, b""].

The engine thread only appends to a queue (dropping, and counting, what a full queue
cannot take): encoding and sending happen on this publisher's own thread, which sends
live batches first and replays in small chunks between them, under a rate shared by all
replays, at most one replay per client and a few clients at once."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from ...engine import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from ...flags import flagged

log = logging.getLogger("pyllama_paged.server")

# The tier routers read from `medium`: this cache is the server's own (vLLM's "GPU"), never
# an offloaded copy that a router would discount, whatever device holds it.
MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
FORMATS = ("array", "map")
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
# replayed batches sent between two looks at the live queue: a replay of the whole buffer
# never holds live events back for more than this many sends
_REPLAY_CHUNK = 32
# a replay whose client reads nothing for this long gives its place up
_REPLAY_STALL_SECONDS = 10.0
_REPLAY_HWM = 1000
# replay requests read per turn of the sender: a flood of them cannot starve the live stream
_REQUESTS_PER_TURN = 64


@dataclass
class KVEventsConfig:
    """Where and how KV-cache events are published (vLLM's KVEventsConfig fields, plus
    bind, token_ids and the replay limits); the flagged fields are `serve`'s --kv-events options."""

    endpoint: str = flagged(
        DEFAULT_ENDPOINT, "--kv-events", "publish the prefix cache's stored and evicted blocks on this ZMQ PUB "
        "endpoint in vLLM's KV-event format, for KV-aware routers (no value: tcp://127.0.0.1:5557; wildcards, "
        "loopback and ipc:// bind, other hosts are connected to). As sensitive as the prompts: docs/scale-out.md",
        nargs="?", const=DEFAULT_ENDPOINT, metavar="ENDPOINT")
    replay_endpoint: str | None = flagged(None, "--kv-events-replay", "ZMQ ROUTER endpoint where a subscriber asks "
                                          "for the batches it missed (bound)", metavar="ENDPOINT")
    topic: str = flagged("", "--kv-events-topic", "ZMQ topic of the KV events", show=lambda v: v or "none")
    buffer_steps: int = 10_000      # batches kept for replay
    max_queue_size: int = 100_000   # batches waiting for the sender before new ones are dropped
    hwm: int = 100_000              # ZMQ's send high-water mark
    # events as tagged arrays (vLLM <= 0.23) or maps (later vLLM)
    format: str = flagged("array", "--kv-events-format", "events as tagged arrays (vLLM up to 0.23) or as maps "
                          "(later vLLM)", choices=list(FORMATS))
    data_parallel_rank: int = 0
    # bind (True) or connect (False) the PUB endpoint; None: bind wildcards, loopback
    # addresses, ipc:// and inproc://, connect to any other host (binds())
    bind: bool | None = flagged(None, "--kv-events-bind", "bind (--no-kv-events-bind: connect to) the --kv-events "
                                "endpoint, whatever its address", action=argparse.BooleanOptionalAction)
    # BlockStored carries the blocks' token ids (every prompt, verbatim) only when asked
    token_ids: bool = flagged(False, "--kv-events-token-ids", "put each stored block's token ids in the events "
                              "(every prompt, verbatim: only on a socket nobody else can reach); default: hashes "
                              "only", action="store_true")
    replay_max_clients: int = 4     # replays in progress at once; more requests get no answer
    replay_rate: int = 10_000       # replayed batches per second, all clients together

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"KV event format must be one of {FORMATS}, got {self.format!r}")
        if self.replay_max_clients < 1 or self.replay_rate < 1:
            raise ValueError(f"KV event replay limits must be >= 1, got {self.replay_max_clients} clients "
                             f"and {self.replay_rate} batches/s")


def event_record(event: KVEvent, fmt: str = "array", token_ids: bool = False):
    """One event as vLLM's msgspec encodes it: a tagged array, or a map tagged by "type"
    (a BlockStored's token ids only with token_ids; an empty list otherwise)."""
    if isinstance(event, BlockStored):
        fields = {"block_hashes": event.block_hashes, "parent_block_hash": event.parent_block_hash,
                  "token_ids": event.token_ids if token_ids else [], "block_size": event.block_size,
                  "lora_id": None, "medium": MEDIUM}
        if fmt == "map":
            fields["lora_name"] = None
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": event.block_hashes, "medium": MEDIUM}
    elif isinstance(event, AllBlocksCleared):
        fields = {}
    else:
        raise TypeError(f"not a KV event: {event!r}")
    tag = type(event).__name__
    return {"type": tag, **fields} if fmt == "map" else [tag, *fields.values()]


def encode_batch(ts: float, events: list[KVEvent], fmt: str = "array", data_parallel_rank: int | None = 0,
                 token_ids: bool = False) -> bytes:
    """A KVEventBatch payload: msgpack [ts, events, data_parallel_rank]."""
    import msgpack

    return msgpack.packb([ts, [event_record(e, fmt, token_ids) for e in events], data_parallel_rank])


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (brackets and a connect's source address dropped), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):].rsplit(";", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_wildcard(host: str) -> bool:
    return host in ("*", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """Whether host names this machine's loopback only."""
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def binds(endpoint: str, bind: bool | None = None) -> bool:
    """Whether the PUB socket binds endpoint (else it connects to it). vLLM's rule binds a
    wildcard, an address with "::", ipc:// or inproc:// and connects to anything else, so a
    loopback IPv4 address could only be connected to; here a loopback host (and 0.0.0.0)
    binds too."""
    if bind is not None:
        return bind
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint_host(endpoint)
    return host is not None and (is_loopback(host) or _is_wildcard(host))


def exposure_warning(endpoint: str, bound: bool, token_ids: bool) -> str | None:
    """The startup warning for an endpoint that others than this machine's accounts may
    reach (a wildcard or another interface, bound), or None."""
    host = endpoint_host(endpoint)
    if not bound or host is None or is_loopback(host):
        return None
    where = "every interface" if _is_wildcard(host) else f"{host}, not loopback"
    what = ("every prompt's token ids" if token_ids else
            "which blocks are cached and when (hashes only, no token ids)")
    return (f"KV events are bound on {endpoint} ({where}) with no authentication (the API key does not "
            f"cover them): whoever reaches it reads {what}; bind loopback or a private network")


def _wants_ipv6(endpoint: str) -> bool:
    host = endpoint_host(endpoint)
    return host is not None and ":" in host


class _Replay:
    """One client's replay in progress: the batches [next_seq, end_seq) still to send."""
    __slots__ = ("client", "next_seq", "end_seq", "progress_at")

    def __init__(self, client: bytes, next_seq: int, end_seq: int, now: float):
        self.client, self.next_seq, self.end_seq, self.progress_at = client, next_seq, end_seq, now


class KVEventPublisher:
    """A KVEventListener that publishes each batch of events on ZMQ from a thread of its own."""

    def __init__(self, config: KVEventsConfig):
        try:
            import zmq
        except ImportError as e:
            raise RuntimeError("KV events need pyzmq and msgpack: pip install 'pyllama-paged[router]'") from e
        if config.format not in FORMATS:
            raise ValueError(f"KV event format must be one of {FORMATS}, got {config.format!r}")
        self.config = config
        self.dropped = 0   # batches the full queue could not take
        self.replays_served = 0    # replays sent to their end
        self.replays_refused = 0   # requests not answered: the client had one running, or too many clients
        self.replays_abandoned = 0   # replays whose client left or stopped reading
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._replays: dict[bytes, _Replay] = {}
        self._replay_moved = False
        self._tokens = float(config.replay_rate)   # the replay rate's bucket
        self._filled_at = time.monotonic()
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        # sockets are made here, so that a bad or busy endpoint fails the server's start;
        # from then on only the sender thread touches them
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        self.bound = binds(config.endpoint, config.bind)
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.ipv6 = _wants_ipv6(config.endpoint)   # libzmq refuses an IPv6 address otherwise
            (self._pub.bind if self.bound else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.ipv6 = _wants_ipv6(config.replay_endpoint)
                # a full or gone client is an error to the sender, not a message silently dropped
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.sndhwm = _REPLAY_HWM
                self._replay.bind(config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        for endpoint, bound in ((config.endpoint, self.bound), (config.replay_endpoint, True)):
            warning = exposure_warning(endpoint, bound, config.token_ids) if endpoint else None
            if warning:
                log.warning(warning)
        log.info("KV events %s %s (token ids %s)", "bound on" if self.bound else "sent to", config.endpoint,
                 "included" if config.token_ids else "left out")
        self._running = True
        self._abandon = False
        self._thread = threading.Thread(target=self._send_loop, name="pyllama-kv-events", daemon=True)
        self._thread.start()

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._seq

    def kv_events(self, events: list[KVEvent]) -> None:
        """Queue one step's events (from the engine thread; never blocks)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: the sender is behind; %d batches dropped", self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to timeout seconds), then stop and close the sockets."""
        if not self._running:
            return
        self._running = False   # the sender drains the queue, then returns
        self._thread.join(timeout)
        self._abandon = True    # past the timeout: what is still queued is dropped
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # ---- the sender thread -----------------------------------------------------
    def _send_loop(self) -> None:
        import zmq

        while True:
            if self._replay is not None:
                try:
                    self._take_requests()
                except zmq.ZMQError:   # a replay client's trouble never stops the live stream
                    log.exception("KV events: reading replay requests failed")
            if self._abandon:
                return
            # live batches first, then one chunk of replay; with no replay that can move, wait
            # for the next live batch (briefly: replay requests are read between waits, and
            # a full client pipe or an empty rate bucket frees up soon)
            if not self._replays:
                wait = 0.05
            else:
                wait = 0.0 if self._replay_moved and self._tokens >= 1 else 0.002
            sent = self._send_live(wait)
            if not sent and not self._running and self._queue.empty():
                return
            self._replay_moved = bool(self._replays) and self._send_replays()

    def _send_live(self, wait: float) -> int:
        """Send every live batch queued now (waiting up to wait for the first); how many."""
        import zmq

        fmt, rank, token_ids = self.config.format, self.config.data_parallel_rank, self.config.token_ids
        sent = 0
        while True:
            try:
                ts, events = self._queue.get(timeout=wait) if wait > 0 and sent == 0 else self._queue.get_nowait()
            except queue.Empty:
                return sent
            payload = encode_batch(ts, events, fmt, rank, token_ids)
            seq = self._seq
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("KV events: sending batch %d failed", seq)
            # kept for replay even if the live send failed: a subscriber asks for what it missed
            self._buffer.append((seq, payload))
            self._seq += 1
            sent += 1
            if self._abandon:
                return sent

    def _take_requests(self) -> None:
        import zmq

        for _ in range(_REQUESTS_PER_TURN):
            if not self._replay.poll(0):
                return
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self._refuse(f"a malformed replay request ({len(frames)} frames; expected identity, empty, "
                             "8-byte start)")
                continue
            client, _, start = frames
            if client in self._replays:
                self._refuse("a replay request from a client whose replay is still running")
                continue
            if len(self._replays) >= self.config.replay_max_clients:
                self._refuse(f"a replay request while {len(self._replays)} replays run")
                continue
            self._replays[client] = _Replay(client, int.from_bytes(start, "big"), self._seq, time.monotonic())

    def _refuse(self, why: str) -> None:
        self.replays_refused += 1
        if self.replays_refused == 1 or self.replays_refused % 1000 == 0:
            log.warning("KV events: %s is not answered (%d refused so far)", why, self.replays_refused)

    def _send_replays(self) -> bool:
        """Up to a chunk of replayed batches, round robin over the clients, within the rate;
        whether anything was sent."""
        import zmq

        now = time.monotonic()
        rate = self.config.replay_rate
        self._tokens = min(float(rate), self._tokens + (now - self._filled_at) * rate)
        self._filled_at = now
        budget = min(_REPLAY_CHUNK, int(self._tokens))
        any_moved = False
        while budget > 0 and self._replays:
            moved = False
            for replay in list(self._replays.values()):
                if budget <= 0:
                    break
                first = self._buffer[0][0] if self._buffer else self._seq
                replay.next_seq = max(replay.next_seq, first)   # older batches left the buffer
                try:
                    if replay.next_seq >= min(replay.end_seq, self._seq):
                        self._replay.send_multipart((replay.client, b"", END_OF_REPLAY, b""), zmq.NOBLOCK)
                        del self._replays[replay.client]
                        self.replays_served += 1
                    else:
                        seq, payload = self._buffer[replay.next_seq - first]
                        self._replay.send_multipart((replay.client, b"", seq.to_bytes(8, "big"), payload),
                                                    zmq.NOBLOCK)
                        replay.next_seq += 1
                        budget -= 1
                        self._tokens -= 1
                    replay.progress_at = now
                    moved = True
                except zmq.Again:   # the client's pipe is full: it reads slowly; later
                    if now - replay.progress_at > _REPLAY_STALL_SECONDS:
                        self._drop_replay(replay, "stopped reading")
                except zmq.ZMQError as e:   # EHOSTUNREACH: the client left
                    self._drop_replay(replay, e.strerror)
            if not moved:
                break
            any_moved = True
        return any_moved

    def _drop_replay(self, replay: _Replay, why: str) -> None:
        self._replays.pop(replay.client, None)
        self.replays_abandoned += 1
        log.info("KV events: a replay was abandoned at batch %d (%s)", replay.next_seq, why)
