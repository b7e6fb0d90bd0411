"""KV-cache events on a ZMQ PUB socket, in vLLM's wire format, for routers that send
each prompt where its prefix is cached (`serve --kv-events tcp://*:5557`).

Each message is three frames: the topic, a sequence number (8 bytes, big-endian) and a
msgpack batch [ts, events, data_parallel_rank]. An event is a tagged array
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
["BlockRemoved", block_hashes, medium] or ["AllBlocksCleared"] (vLLM before its map
encoding), or with `format="map"` a map with the tag under "type" and the fields by name
(vLLM since it dropped positional events). A ROUTER socket (the replay endpoint) answers a
request [empty frame, 8-byte start sequence number] with every batch still buffered from
that number on, as [empty, seq, payload] messages, then [empty, -1, b""].

The engine thread only appends to a queue (dropping, and counting, what a full queue
cannot take): encoding and sending happen on this publisher's own thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("pyllama_paged.server")

# The tier routers read from `medium`: this cache is the server's own (vLLM's "GPU"), never
# an offloaded copy that a router would discount, whatever device holds it.
MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
FORMATS = ("array", "map")


@dataclass
class KVEventsConfig:
    """Where and how KV-cache events are published (vLLM's KVEventsConfig fields)."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000      # batches kept for replay
    max_queue_size: int = 100_000   # batches waiting for the sender before new ones are dropped
    hwm: int = 100_000              # ZMQ's send high-water mark
    format: str = "array"           # events as tagged arrays (vLLM <= 0.23) or maps (later vLLM)
    data_parallel_rank: int = 0


def event_record(event: KVEvent, fmt: str = "array"):
    """One event as vLLM's msgspec encodes it: a tagged array, or a map tagged by "type"."""
    if isinstance(event, BlockStored):
        fields = {"block_hashes": event.block_hashes, "parent_block_hash": event.parent_block_hash,
                  "token_ids": event.token_ids, "block_size": event.block_size, "lora_id": None,
                  "medium": MEDIUM}
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


def encode_batch(ts: float, events: list[KVEvent], fmt: str = "array", data_parallel_rank: int | None = 0) -> bytes:
    """A KVEventBatch payload: msgpack [ts, events, data_parallel_rank]."""
    import msgpack

    return msgpack.packb([ts, [event_record(e, fmt) for e in events], data_parallel_rank])


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ipc or inproc endpoint is bound; any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


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
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        # sockets are made here, so that a bad or busy endpoint fails the server's start;
        # from then on only the sender thread touches them
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._running = True
        self._abandon = False
        self._thread = threading.Thread(target=self._send_loop, name="pyllama-kv-events", daemon=True)
        self._thread.start()

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

    def _send_loop(self) -> None:
        import zmq

        seq = 0
        fmt, rank = self.config.format, self.config.data_parallel_rank
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except zmq.ZMQError:   # a replay client's trouble never stops the live stream
                    log.exception("KV events: replay request failed")
            if self._abandon:
                return
            try:
                ts, events = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            payload = encode_batch(ts, events, fmt, rank)
            number = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, number, payload))
            except zmq.ZMQError:
                log.exception("KV events: sending batch %d failed", seq)
            # kept for replay even if the live send failed: a subscriber asks for what it missed
            self._buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request has %d frames, not 3 (identity, empty, start)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
