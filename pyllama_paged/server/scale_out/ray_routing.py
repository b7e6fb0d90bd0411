"""Which replica of a Ray Serve deployment serves a request: prefix-cache affinity.

Each replica has its own KV pool and prefix cache, so a request whose prompt starts like
an earlier one is cheapest where that one ran: its leading pages are cached there. The
ingress (server/scale_out/ray_app.py) reads the request body and hands the replicas a
RoutedRequest carrying the prompt's leading text; PrefixAffinityRouter, a request router
over Ray Serve's public RequestRouter API (Ray >= 2.46), ranks the replicas for that text
by rendezvous hashing (the same text always prefers the same replica; when a replica
goes, only its texts move) and lets Serve take the least loaded one instead when the
preferred one has more requests in flight than the least loaded one plus a margin.

The field is named `prompt` so Ray's own PrefixCacheAffinityRouter (ray[llm], which needs
pyarrow and vLLM's extras) reads the same requests, should a deployment configure it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PIN_HEADER = "x-pyllama-replica"   # a request naming a replica goes to it; every answer names its replica
POLICIES = ("prefix", "round_robin")
_MAX_DEPTH = 6   # content parts nest a few levels (messages -> content -> parts); deeper is not a prompt


@dataclass
class RoutedRequest:
    """One HTTP request on its way from the ingress to a replica's app."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    scheme: str = "http"
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    prompt: str = ""             # the leading text routing hashes ("" : any replica, least loaded)
    replica: str | None = None   # a replica's id from PIN_HEADER: sent there while it is running

    def scope(self) -> dict:
        """The ASGI HTTP scope the replica's app is called with."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": self.scheme, "path": self.path,
                "raw_path": self.path.encode("utf-8", "surrogateescape"), "root_path": "",
                "query_string": self.query_string, "headers": list(self.headers), "client": self.client,
                "server": self.server, "state": {}}


def _texts(value: Any, depth: int = 0) -> Iterator[str]:
    """The strings of a prompt field in reading order: a string, a list of them, messages
    or content parts with "content" or "text"."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item, depth + 1)
    elif isinstance(value, dict):
        inner = value.get("content", value.get("text"))
        if inner is not None:
            yield from _texts(inner, depth + 1)


def _opening(conversation: Any) -> Any:
    """A conversation's messages up to its first user message (the system prompt before it):
    what every later turn of it repeats, so all its turns share one key. Anything else
    (a prompt, a string input) is taken whole."""
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        return conversation   # a prompt, or several (OpenAI's completions)
    for i, message in enumerate(conversation):
        if message.get("role", "user") == "user":
            return conversation[:i + 1]
    return conversation


def routing_text(body: bytes, chars: int) -> str:
    """The routing key of a request's JSON body: the model name and the first `chars`
    characters of the text the model reads first, up to the conversation's first user
    message (Ollama's and Anthropic's system, the Responses API's instructions, then the
    messages, prompt or input); "" when the body has none. A system prompt longer than
    `chars` alone makes the key (every user of an app shares it); a shorter one with the
    first question keys one conversation, whose turns then share a replica."""
    if chars <= 0 or not body:
        return ""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return ""   # not JSON: the replica's app answers with the error
    if not isinstance(parsed, dict):
        return ""
    conversation = next((parsed[k] for k in ("messages", "prompt", "input") if k in parsed), None)
    taken, size = [], 0
    for value in (parsed.get("system"), parsed.get("instructions"), _opening(conversation)):
        for text in _texts(value):
            taken.append(text[:chars - size])
            size += len(taken[-1])
            if size >= chars:
                break
        if size >= chars:
            break
    if not size:
        return ""
    model = parsed.get("model")
    return f"{model if isinstance(model, str) else ''}\n{''.join(taken)}"


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """replica_ids from the one key prefers most to the least (highest random weight):
    the order of the others does not change when one replica leaves or joins."""
    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{replica_id}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def routed_request(pending: PendingRequest | None) -> RoutedRequest | None:
    """The RoutedRequest among a pending call's arguments, if any. Found by its fields, not
    its class: Serve may ship the router by value, with a copy of this module's classes."""
    if pending is None:
        return None
    return next((a for a in list(pending.args) + list(pending.kwargs.values())
                 if hasattr(a, "prompt") and hasattr(a, "replica")), None)


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas for each request: pinned, prefix affinity (policy "prefix") or
    strict rotation (policy "round_robin", the baseline benchmarks compare against).

    Serve takes the least loaded replica of the first rank that has room (fewer requests
    in flight than max_ongoing_requests), probing queue lengths it does not know; so a
    rank of one is a preference that yields only to a full replica. No FIFO mixin: a
    replica chosen for one request must not be handed to another one waiting."""

    def initialize_state(self, policy: str = "prefix", imbalance: int = 8, **kwargs) -> None:
        """policy: "prefix" or "round_robin"; imbalance: how many more requests in flight
        than the least loaded replica the preferred one may have before it is passed over."""
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.imbalance = imbalance
        self._turn = 0

    def _in_flight(self, replica: RunningReplica) -> int | None:
        return self.replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas, most preferred first (Ray's RequestRouter contract)."""
        if pending_request is not None:
            # every rank below is final: when none has room Serve should back off (and wait
            # longer for queue lengths) before asking again, not probe in a tight loop
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request = routed_request(pending_request)
        if request is not None and request.replica in by_id:
            return [[by_id[request.replica]]]
        if self.policy == "round_robin":
            ids = sorted(by_id)
            start = self._turn % len(ids)
            self._turn += 1
            order = ids[start:] + ids[:start]
            return [[by_id[order[0]]], [by_id[i] for i in order[1:]]]
        if request is None or not request.prompt:
            return [candidate_replicas]   # nothing cached to seek: the least loaded of all
        order = [by_id[i] for i in rendezvous_order(request.prompt, list(by_id))]
        preferred, others = order[0], order[1:]
        loads = [n for n in map(self._in_flight, order) if n is not None]
        mine = self._in_flight(preferred)
        if others and mine is not None and loads and mine - min(loads) > self.imbalance:
            # overloaded: a cold cache elsewhere beats waiting behind this queue
            return [others, [preferred]]
        return [[preferred], others] if others else [[preferred]]
