"""Replicas of the server on Ray Serve, routed by prefix-cache affinity.

Two deployments make one Serve application:

- PagedEngine, N replicas: each is the whole single-box server (create_app over a
  ModelRegistry: its models, engine loops and KV pools), called through
  `forward(RoutedRequest)`, which runs one HTTP request through that app in-process and
  streams back its status line, headers and body chunks as the app sends them (NDJSON
  and server-sent events stream through unchanged). check_health reports a stopped or
  unanswering engine to Serve, which replaces the replica; on shutdown Serve stops
  routing to it, waits up to graceful_shutdown_timeout_s for its requests to finish,
  then the engines close.
- PrefixIngress, one replica, no CPU of its own: Serve's HTTP proxy hands it each
  request; it reads the body, takes the prompt's leading text (ray_routing.routing_text)
  and calls PagedEngine's handle with it, so the deployment's request router
  (ray_routing.PrefixAffinityRouter by default) can place the request where that prefix
  is cached. Serve's HTTP proxy cannot show a router the body, hence this hop.

Every answer carries `x-pyllama-replica: <id>`; a request with that header goes to that
replica (its /metrics, /api/pool). GET /ray/replicas lists the replicas with their
engines' figures (prefix-cache hits, computed tokens). A replica that dies mid-stream
ends its streams with the protocol's error event (an Ollama error line, an OpenAI or
Anthropic error event); Serve stops routing to it and starts a replacement.

Run it with `pyllama-paged serve --ray ADDRESS` (run_on_ray) or with Serve's own tools
through the application builder `pyllama_paged.server.scale_out.ray_app:build` (see
docs/scale-out.md). Importing pyllama_paged never imports this module (nor Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import ReplicaID
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..api_keys import APIKeys
from ..app import AccessPolicy, OriginPolicy, create_app, error_response, request_headers
from ..error_bodies import anthropic_error_body
from ..config import Limits, ScaleOut, ServeConfig
from ..generation import limit_flag
from .ray_routing import PIN_HEADER, POLICIES, PrefixAffinityRouter, RoutedRequest, routing_text
from ..registry import ModelRegistry
from ..sse import openai_error_events, sse
from ..routing.router_contract import unhealthy_reason

log = logging.getLogger("pyllama_paged.server")

APP_NAME = "pyllama-paged"
ENGINE_DEPLOYMENT = "PagedEngine"
INGRESS_DEPLOYMENT = "PrefixIngress"
# a step of a healthy engine takes well under this; Serve's health check gives up at 30 s
ENGINE_ANSWER_S = 20.0


def router_config(scale: ScaleOut) -> RequestRouterConfig | None:
    """The Serve request-router settings of the engine deployment (None: Serve's default)."""
    if scale.router == "pow2":
        return None
    if scale.router in POLICIES:
        return RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                   request_router_kwargs={"policy": scale.router, "imbalance": scale.imbalance})
    return RequestRouterConfig(request_router_class=scale.router)


def _stream_error(content_type: str, path: str, message: str) -> bytes:
    """The end of a stream whose replica failed after its 200, in the stream's protocol:
    Ollama's error line, Anthropic's error event, OpenAI's error event; b"" for a body
    with no error syntax (the connection just ends short)."""
    if content_type.startswith("application/x-ndjson"):
        return (json.dumps({"error": message}) + "\n").encode()
    if content_type.startswith("text/event-stream"):
        if path.startswith("/v1/messages"):
            return sse(anthropic_error_body(503, message), "error").encode()
        return openai_error_events(message, "server_error", None, "replica_failed").encode()
    return b""


class PagedEngine:
    """One replica: the server's app over its own models, engines and KV pools."""

    async def __init__(self, config: ServeConfig):
        # loading weights takes seconds: off the replica's event loop (Serve's health and
        # queue-length calls run on it)
        self.registry = await asyncio.to_thread(ModelRegistry, config.models, config)
        self.app = create_app(self.registry, config.limits, config.api_keys(), config.origins, config.host)
        self.state = self.app.state.pp
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # the app's startup and shutdown handlers (its idle-model watcher, its prep threads)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

    async def forward(self, request: RoutedRequest):
        """Run one HTTP request through this replica's app: first {"status", "headers"},
        then the body's chunks as the app sends them."""
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive():
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()   # the caller went away (or the answer is complete)
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        task = asyncio.get_running_loop().create_task(self.app(request.scope(), receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        answered = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    answered = True
                    headers = list(message.get("headers", [])) + [(PIN_HEADER.encode(), self.replica_id.encode())]
                    yield {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if not answered:
                task.result()   # the app's own failure, for the ingress to answer with a 500
                raise RuntimeError("the replica's app ended without an answer")
        finally:
            # a caller that left (Serve cancels this generator) is a client disconnect to the
            # app: its generation is aborted and its pages go back to the pool
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, 10)

    async def figures(self, request: RoutedRequest | None = None) -> dict:
        """This replica's id, place and engines' figures (for /ray/replicas); request only
        carries the pin that routes the call here."""
        models = {}
        for name, served in list(self.registry.models.items()):
            found, _ = await served.figures(self.state.limits.stats_timeout)
            models[name] = found["stats"] if found is not None else None
        return {"replica": self.replica_id, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "host": os.uname().nodename, "healthy": unhealthy_reason(self.state) is None, "models": models}

    async def check_health(self) -> None:
        """Serve's periodic health check: an engine that stopped, or that has not answered
        between its steps for ENGINE_ANSWER_S, makes the replica unhealthy."""
        reason = unhealthy_reason(self.state)
        if reason is not None and not self.state.draining:
            raise RuntimeError(reason)
        for served in list(self.registry.models.values()):
            # on the model's own figures thread, one call at a time: a wedged engine holds
            # no shared thread however often Serve asks
            _, current = await served.figures(ENGINE_ANSWER_S)
            if served.is_loaded and not current:
                raise RuntimeError(f"the engine of {served.name} has not answered for {ENGINE_ANSWER_S:g} s")

    async def __del__(self):
        # Serve calls this after the drain (no requests left, or graceful_shutdown_timeout_s)
        self.state.draining = True
        with contextlib.suppress(Exception):
            await self._lifespan.aclose()
        await asyncio.to_thread(self.registry.close)


class _Relay(Response):
    """A response that relays a replica's answer: its status and raw headers, then its body
    chunks as they arrive; a replica failing mid-answer ends the body with an error event."""

    def __init__(self, head: dict, chunks, path: str):
        super().__init__()
        self.head, self.chunks, self.path = head, chunks, path

    async def __call__(self, scope, receive, send) -> None:
        headers = self.head["headers"]
        await send({"type": "http.response.start", "status": self.head["status"], "headers": headers})
        content_type = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), "")
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as e:   # the replica died or failed mid-answer: only this answer ends
            log.warning("replica failed mid-answer on %s: %s", self.path, e)
            tail = _stream_error(content_type, self.path, f"the replica serving this request failed: {e}")
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class PrefixIngress:
    """The HTTP entry: each request to PagedEngine with the prompt prefix its router reads."""

    def __init__(self, engine, max_body_bytes: int, prefix_chars: int, api_key: APIKeys | str | None = None,
                 origins: tuple[str, ...] = (), host: str | None = None):
        self.engine = engine.options(stream=True)
        self.max_body_bytes, self.prefix_chars = max_body_bytes, prefix_chars
        self.figures = engine.options(stream=False).figures
        # the replicas check every relayed request themselves; what the ingress answers on its
        # own (/ray/replicas: ids, nodes, pids, hosts) needs the same checks here
        self.access = AccessPolicy(APIKeys.of(api_key), OriginPolicy(origins), host)

    async def __call__(self, request: Request) -> Response:
        """Route one HTTP request to a replica and relay its answer."""
        path = request.url.path
        if path == "/ray/replicas" and request.method == "GET":
            headers = request_headers(request.scope)
            refusal = self.access.refuse_caller(request.scope, headers) or self.access.refuse_key(request.scope,
                                                                                                 headers)
            return refusal or JSONResponse({"replicas": await self.replicas()})
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_big(path)
        body = b""
        async for part in request.stream():   # read with the cap: a huge body never sits here whole
            body += part
            if len(body) > self.max_body_bytes:
                return self._too_big(path)
        scope = request.scope
        routed = RoutedRequest(method=request.method, path=path, query_string=scope.get("query_string", b""),
                               headers=list(scope.get("headers", [])), body=body,
                               scheme=scope.get("scheme", "http"), client=scope.get("client"),
                               server=scope.get("server"), prompt=routing_text(body, self.prefix_chars),
                               replica=request.headers.get(PIN_HEADER))
        chunks = self.engine.forward.remote(routed)
        try:
            head = await chunks.__anext__()
        except Exception as e:   # no replica answered (it died before its first byte, or failed)
            log.warning("no answer from a replica for %s: %s", path, e)
            return error_response(path, 503, f"the replica serving this request failed: {e}",
                                  error_type="server_error", code="replica_failed")
        return _Relay(head, chunks, path)

    def _too_big(self, path: str) -> Response:
        limit = self.max_body_bytes
        return error_response(path, 413, f"request body larger than {limit} bytes (the server's "
                                         f"{limit_flag('max_body_bytes')} option)", code="limit_exceeded")

    async def replicas(self) -> list[dict]:
        """Each running PagedEngine replica's figures, each asked of that replica (pinned)."""
        context = serve.get_replica_context()
        ids = []
        for actor in ray.util.list_named_actors(all_namespaces=True):
            name = actor["name"] if isinstance(actor, dict) else actor
            if ReplicaID.is_full_id_str(name):
                rid = ReplicaID.from_full_id_str(name)
                if rid.deployment_id.app_name == context.app_name and rid.deployment_id.name == ENGINE_DEPLOYMENT:
                    ids.append(rid.unique_id)
        # one after another: calls made at once from one HTTP request share Serve's internal
        # request id, and a router without Serve's FIFO mixin (ours) fulfils by that id
        seen: dict[str, dict] = {}
        for i in ids:
            try:
                answer = await self.figures.remote(RoutedRequest("GET", "/ray/replicas", replica=i))
            except Exception as e:   # gone since it was listed
                log.info("replica %s did not answer: %s", i, e)
                continue
            # a replica not routable yet (loading) or gone is answered for by another: kept once
            seen.setdefault(answer["replica"], answer)
        return sorted(seen.values(), key=lambda a: a["replica"])


def build_application(config: ServeConfig):
    """The Serve application: config.scale_out.replicas PagedEngine replicas behind PrefixIngress."""
    scale = config.scale_out or ScaleOut()
    actor_options: dict[str, Any] = {"num_cpus": scale.replica_cpus if scale.replica_cpus is not None else 1.0}
    if scale.replica_memory:
        actor_options["memory"] = scale.replica_memory
    engine_options: dict[str, Any] = dict(
        name=ENGINE_DEPLOYMENT, num_replicas=scale.replicas, ray_actor_options=actor_options,
        max_ongoing_requests=scale.max_ongoing_requests,
        graceful_shutdown_timeout_s=scale.graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=scale.health_check_period_s)
    router = router_config(scale)
    if router is not None:
        engine_options["request_router_config"] = router
    engine = serve.deployment(PagedEngine).options(**engine_options)
    # the ingress only relays: no CPU reserved (it fits beside a replica on any node), and
    # room for every replica's requests at once
    ingress = serve.deployment(PrefixIngress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1, scale.replicas * scale.max_ongoing_requests),
        graceful_shutdown_timeout_s=scale.graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s=0.5)
    config = dataclasses.replace(config, models=[os.path.abspath(m) for m in config.models] if config.models else None)
    return ingress.bind(engine.bind(config), config.limits.max_body_bytes, scale.prefix_chars, config.api_keys(),
                        tuple(config.origins), config.host)


def build(args: dict) -> Any:
    """Serve's application builder (`serve run pyllama_paged.server.scale_out.ray_app:build k=v ...`
    or a config file's import_path): ScaleOut fields at the top level, plus "models" (GGUF
    paths; none: the embedded default), "engine" (EngineConfig fields, SchedulerConfig ones
    flat: ServeConfig.flat), "limits" (Limits fields), "api_key" (one or a list), "api_key_file" (the
    same path on every node), "origins" and "host"."""
    return build_application(build_config(args))


def build_config(args: dict) -> ServeConfig:
    """build()'s arguments as one ServeConfig (ValueError for an unknown one)."""
    args = dict(args)
    scale_fields = {f.name for f in dataclasses.fields(ScaleOut)}
    known = scale_fields | {"models", "engine", "limits", "api_key", "api_key_file", "origins", "host"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    # `serve run ... replicas=2` passes strings: each ScaleOut field's default type converts them
    defaults = ScaleOut(replica_cpus=1.0)
    scale = ScaleOut(**{"replica_cpus": 1.0, **{k: _coerce(v, getattr(defaults, k)) for k, v in args.items()
                                                  if k in scale_fields}})
    engine = dict(args.get("engine") or {})
    engine.setdefault("n_threads", max(1, int(scale.replica_cpus)))
    return ServeConfig.flat(**engine, limits=Limits(**(args.get("limits") or {})), scale_out=scale,
                            models=_listed(args.get("models")) or None, api_key=args.get("api_key"),
                            api_key_file=args.get("api_key_file"), origins=tuple(_listed(args.get("origins"))),
                            host=args.get("host"))


def _listed(value) -> list[str]:
    """A list argument, also as one comma-separated string (how `serve run` passes it)."""
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return list(value or [])


def _coerce(value: Any, default: Any) -> Any:
    """A builder argument given as text, as the type of its field's default."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    if value.lower() in ("none", ""):
        return None
    return type(default)(value) if default is not None else int(value)


def run_on_ray(config: ServeConfig) -> int:
    """Deploy the application on the Ray cluster at config.scale_out.address with Serve's HTTP
    proxy on config.host:config.port, and keep it until SIGINT or SIGTERM; then delete it, which
    drains every replica (requests in flight finish, up to graceful_shutdown_timeout_s)."""
    scale, host, port = config.scale_out, config.host, config.port
    address = scale.address
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        # one proxy, on the head node: Serve's default, one per node, would have every node
        # bind host:port (and several nodes on one machine collide)
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
        app = build_application(config)
        serve.run(app, name=APP_NAME, route_prefix="/")
        at = _proxy_address(host, port)
        if at != (host, port):
            print(f"Serve was already running on this cluster: its HTTP proxy stays at {at[0]}:{at[1]} "
                  f"(Serve applies --host/--port when it first starts)", flush=True)
        print(f"serving on http://{at[0]}:{at[1]} with {scale.replicas} replica(s) on Ray at {address} "
              f"(routing: {scale.router}); Ctrl-C drains and stops", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        print("draining: the replicas finish their requests, then stop", flush=True)
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    return 0


def _proxy_address(host: str, port: int) -> tuple[str, int]:
    """Where Serve's HTTP proxy listens: a Serve instance keeps the http_options of its first
    start, whatever a later start asks. Read through Serve's client (not public API: when
    that fails, the address asked for)."""
    try:
        from ray.serve.context import _get_global_client

        config = _get_global_client().http_config
        return config.host, config.port
    except Exception:
        return host, port
