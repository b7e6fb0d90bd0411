"""The HTTP server: app factory, Host/Origin, API-key and body-size guards, CORS
(Starlette's), error shapes, metrics, the live block-pool dashboard, and `serve`."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from .._version import __version__
from ..errors import ModelLoadError, ModelsBusyError
from ..tokenizer import render_pool
from .dashboard import DASHBOARD_HTML
from .config import ORIGINS_ENV, Limits, ServeConfig
from .generation import APIError, limit_flag
from .routing.kv_events import KVEventPublisher
from .metrics import Metrics
from .registry import ModelRegistry
from .anthropic import api as anthropic_api
from .api_keys import APIKeys
from .pooling import embeddings as embeddings_api
from .ollama import api as ollama_api, manage as ollama_manage
from .openai import api as openai_api, responses as openai_responses
from .pooling import rerank as rerank_api
from .routing import router_contract
from .error_bodies import anthropic_error_body, openai_error_object
from .lookup import find_model
from .openai.responses_store import ResponseStore
from .state import server_state

log = logging.getLogger("pyllama_paged.server")

# Ollama's default allow-list (OLLAMA_ORIGINS adds to it): local pages on any port, desktop
# app shells and browser extensions
DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
                        for scheme in ("http", "https") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
    "chrome-extension://*", "moz-extension://*", "safari-extension://*", "ms-browser-extension://*")
CORS_METHODS = ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS")


class OriginPolicy:
    """Which browser origins may call the server: the defaults plus the extra patterns
    (`*` matches anything, a `:*` port any port; a lone `*` allows every origin), as one
    regular expression: the refusal of other origins and CORSMiddleware's allow_origin_regex."""

    def __init__(self, extra: list[str] | tuple[str, ...] = ()):
        self.patterns = list(DEFAULT_ORIGINS) + list(extra)
        parts = []
        for pattern in self.patterns:
            rx = re.escape(pattern.lower())
            rx = rx[:-len(r":\*")] + r":\d+" if rx.endswith(r":\*") else rx
            parts.append(rx.replace(r"\*", ".*"))
        # case-insensitive: schemes and host names are
        self.regex = "(?i)" + "|".join(f"(?:{p})" for p in parts)
        self._rx = re.compile(self.regex)

    def allows(self, origin: str) -> bool:
        """Whether a request with this Origin header may be served."""
        return self._rx.fullmatch(origin.strip()) is not None


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """The name in a Host header, without its port ("[::1]:80" -> "::1")."""
    if host_header.startswith("["):
        return host_header[1:host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class RedactKey(logging.Filter):
    """Hides the API key of `?key=` in uvicorn's access log lines."""

    _KEY = re.compile(r"([?&]key=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's arguments; never drops it."""
        if isinstance(record.args, tuple):
            record.args = tuple(self._KEY.sub(r"\1<redacted>", a) if isinstance(a, str) else a
                                for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = self._KEY.sub(r"\1<redacted>", record.msg)
        return True


def _redact_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    # a filter on the logger (not a handler) outlives uvicorn's logging setup; added once per process
    if not any(isinstance(f, RedactKey) for f in access.filters):
        access.addFilter(RedactKey())


@dataclass
class ServerState:
    registry: ModelRegistry
    limits: Limits
    metrics: Metrics
    api_keys: APIKeys = field(default_factory=APIKeys)
    origins: OriginPolicy = field(default_factory=OriginPolicy)
    bind_host: str | None = None   # None: the address each connection came in on
    # tokenizing, templates, grammars, tool-call parsing: a few threads of their own
    prep: ThreadPoolExecutor | None = None
    draining: bool = False   # stopping: /health answers 503 while requests still finish
    responses: ResponseStore = field(default_factory=ResponseStore)   # the Responses API's, one per app

    def __post_init__(self):
        if self.prep is None:
            self.prep = ThreadPoolExecutor(max(1, self.limits.prep_threads), thread_name_prefix="pyllama-prep")
        render_pool.configure(self.limits.render_limits(), warm=True)   # chat templates: out of process


def _is_openai(path: str) -> bool:
    return path.startswith("/v1/") or openai_api.is_unversioned_openai(path)


def error_response(path: str, status: int, message: str, param: str | None = None,
                   error_type: str = "invalid_request_error", headers: dict | None = None,
                   code: str | None = None) -> JSONResponse:
    """Anthropic's error shape on /v1/messages, OpenAI's elsewhere under /v1, Ollama's {"error": ...}
    elsewhere."""
    if path.startswith("/v1/messages"):
        body = anthropic_error_body(status, message)
    elif _is_openai(path):
        body = {"error": openai_error_object(message, error_type, param, code)}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def _is_health_probe(scope) -> bool:
    """GET/HEAD /health: answered without the key, as vLLM answers it, because routers and
    Kubernetes probes carry none; it says only whether the server can take work."""
    return scope["path"] == "/health" and scope["method"] in ("GET", "HEAD")


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call: the Host check (DNS rebinding), the Origin allow-list (pages of other
    sites) and the API key. The server's middleware and Ray's ingress both ask it."""

    api_keys: APIKeys = field(default_factory=APIKeys)
    origins: OriginPolicy = field(default_factory=OriginPolicy)
    bind_host: str | None = None   # None: the address each connection came in on

    def _host_refused(self, scope, host_header: str) -> bool:
        """Bound to a loopback address, only loopback names may be asked for: a page whose
        name was rebound to 127.0.0.1 sends its own name, and is refused."""
        bound = self.bind_host or (scope.get("server") or ("",))[0] or ""
        if not _is_loopback(bound):
            return False
        return bool(host_header) and not _is_loopback(_host_name(host_header))

    def refuse_caller(self, scope, headers: dict[str, str]) -> Response | None:
        """A 403 for a refused Host or Origin, else None."""
        path = scope["path"]
        if self._host_refused(scope, headers.get("host", "")):
            return error_response(path, 403, f"host {headers['host']!r} is not allowed: a server bound to a "
                                  "loopback address answers only to localhost, 127.0.0.1 or [::1]")
        origin = headers.get("origin")
        if origin is not None and not self.origins.allows(origin):
            return error_response(path, 403, f"origin {origin!r} is not allowed (add it with --origins or "
                                  f"{ORIGINS_ENV})")
        return None

    def refuse_key(self, scope, headers: dict[str, str]) -> Response | None:
        """A 401 when keys are required and the request carries none of them, else None."""
        if not self.api_keys.required or _is_health_probe(scope):
            return None
        auth = headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        if not given:
            query = scope.get("query_string", b"").decode("latin-1")
            given = next((p[4:] for p in query.split("&") if p.startswith("key=")), "")
        if self.api_keys.accepts(given):
            return None
        return error_response(scope["path"], 401, "invalid or missing API key", None, "invalid_request_error",
                              code="invalid_api_key")


def request_headers(scope) -> dict[str, str]:
    """A request's headers, names lowercased; latin-1: the bytes HTTP allows, none of which
    may be a 500."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class CallerMiddleware:
    """The Host check and the Origin allow-list on every route, before anything else (CORS
    included): a 403 in the route's error shape. Starlette's TrustedHostMiddleware cannot say
    this rule: it applies only to a server bound to a loopback address (each connection's,
    unless the bound host is given), and admits every loopback address (127.0.0.0/8, ::1)."""

    def __init__(self, app, access: AccessPolicy):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (resp := self.access.refuse_caller(scope, request_headers(scope))):
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class LocalCORSMiddleware(CORSMiddleware):
    """Starlette's CORS with a browser's preflight answered 204 No Content, as Ollama answers
    it (Starlette's says 200 "OK"). A preflight carries no credentials: it is answered here,
    before the key check, for the origins CallerMiddleware let through."""

    def preflight_response(self, request_headers) -> Response:
        """Starlette's preflight answer, without a body when it allows the request."""
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            return response
        kept = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return Response(status_code=204, headers=kept)


class GuardMiddleware:
    """The API key on every route, JSON bodies whatever their content type, and a cap on
    request body size."""

    def __init__(self, app, state: ServerState, access: AccessPolicy):
        self.app, self.state, self.access = app, state, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = request_headers(scope)
        if (resp := self.access.refuse_key(scope, headers)) is not None:
            return await resp(scope, receive, send)
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            # Ollama's own examples post JSON with curl -d (form content type): parse it as JSON.
            # A page of another site cannot get here: CallerMiddleware refused its Origin.
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        limit = self.state.limits.max_body_bytes
        too_big = f"request body larger than {limit} bytes (the server's {limit_flag('max_body_bytes')} option)"
        try:
            declared = int(headers.get("content-length", "0") or 0)
        except ValueError:
            declared = 0   # h11 refuses a malformed length before we see it; be safe anyway
        if declared > limit:
            resp = error_response(path, 413, too_big, code="limit_exceeded")
            return await resp(scope, receive, send)
        seen = 0

        async def capped_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Starlette's type: FastAPI re-raises it from body parsing, where any
                    # other exception becomes a vague 400
                    raise HTTPException(413, too_big)
            return message

        return await self.app(scope, capped_receive, send)


# The contract the generated OpenAPI schema cannot see: every error (FastAPI's
# 422 included, which the handler below turns into 400) has error_response's
# shape; generation routes stream NDJSON (Ollama) or server-sent events
# (OpenAI) when asked to, and answer 503 when the queue is full.
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"anyOf": [
        {"type": "string"},  # Ollama
        {"type": "object", "required": ["message", "type"],  # OpenAI
         "properties": {"message": {"type": "string"}, "type": {"type": "string"}}},
    ]}},
}
_NDJSON = ("application/x-ndjson", {"type": "object"})  # each line
_SSE = ("text/event-stream", {"type": "object", "required": ["data"],  # each event
                              "properties": {"data": {"type": "string"}}})
_STREAMS = {"/api/generate": _NDJSON, "/api/chat": _NDJSON, "/v1/completions": _SSE, "/v1/chat/completions": _SSE,
            "/api/pull": _NDJSON, "/api/create": _NDJSON}
_STREAMS["/v1/messages"] = _SSE   # Anthropic's
_STREAMS["/v1/responses"] = _SSE


def _document_errors(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for path, operations in schema.get("paths", {}).items():
                for op in operations.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    responses["4XX"] = {"description": "Invalid request, unknown model or limit exceeded", **error}
                    if path in _STREAMS:
                        ok = responses.setdefault("200", {"description": "Successful Response"})
                        media_type, item = _STREAMS[path]
                        ok.setdefault("content", {})[media_type] = {"schema": item}
                        responses["503"] = {"description": "Server busy: the request queue is full", **error}
                    if path == "/api/pull":
                        responses["502"] = {"description": "The model's source could not be reached, or sent "
                                                           "a file that failed its sha256 check", **error}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _expire_idle_models(app: FastAPI, registry: ModelRegistry, every: float = 0.5) -> None:
    """While the server runs, drop each model whose keep_alive has run out (Ollama's
    keep_alive durations; 0 is handled by the request itself)."""
    tasks: list[asyncio.Task] = []

    async def watch():
        while True:
            await asyncio.sleep(every)
            now = time.time()
            for served in list(registry.models.values()):
                try:
                    if served.expired(now):
                        await served.unload_if_idle()
                except Exception:   # one failure must not end the watching (models would never go)
                    log.exception("keep_alive: unloading %s failed; still watching", served.name)

    async def start():
        tasks.append(asyncio.get_running_loop().create_task(watch()))

    async def stop():
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)


def route_label(scope) -> str:
    """The metrics label of a request: its route's template, never the raw path (one series
    per probed URL would grow without bound)."""
    route = scope.get("route")
    return getattr(route, "path_format", None) or getattr(route, "path", None) or "(unmatched)"


def create_app(registry: ModelRegistry, limits: Limits | None = None, api_key: APIKeys | str | None = None,
               origins: list[str] | tuple[str, ...] = (), host: str | None = None) -> FastAPI:
    """The ASGI app serving the registry's models. api_key: the key, keys or APIKeys a
    request must carry one of (None: none); origins: browser origins allowed beside the
    defaults; host: the address the server is bound to (None: each connection's)."""
    state = ServerState(registry, limits or Limits(), Metrics(), APIKeys.of(api_key), OriginPolicy(origins), host)
    app = FastAPI(title="pyllama-paged", version=__version__)
    app.state.pp = state
    access = AccessPolicy(state.api_keys, state.origins, state.bind_host)
    # the last added runs first: Host and Origin, then CORS (preflights answered, headers on
    # every answer after it, refusals of the key included), then the key and the body cap
    app.add_middleware(GuardMiddleware, state=state, access=access)
    app.add_middleware(LocalCORSMiddleware, allow_origin_regex=state.origins.regex, allow_methods=CORS_METHODS,
                       allow_headers=["*"])
    app.add_middleware(CallerMiddleware, access=access)
    _redact_access_log()
    _add_error_handlers(app, state)
    _expire_idle_models(app, registry)

    async def stop_prep():
        state.prep.shutdown(wait=False, cancel_futures=True)

    app.router.on_shutdown.append(stop_prep)
    for routes in (ollama_api.router, ollama_manage.router, openai_api.router, openai_responses.router,
                   # llama-server's /embeddings beside /v1/embeddings (openai_api's routes add their own)
                   openai_api.add_unversioned(embeddings_api.router), rerank_api.router, anthropic_api.router,
                   router_contract.router, router):
        app.include_router(routes)
    _document_errors(app)
    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error in the shape of the API it was asked of, counted in /metrics."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        state.metrics.count_request(route_label(request.scope), exc.status)
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.type, exc.headers,
                              exc.code)

    @app.exception_handler(ModelLoadError)
    async def load_error(request: Request, exc: ModelLoadError):
        # a stored model asked for by name that does not load (Ollama answers 500 too); no
        # room for it while every loaded model is busy is a 503 a client may retry
        status = 503 if isinstance(exc, ModelsBusyError) else 500
        state.metrics.count_request(route_label(request.scope), status)
        return error_response(request.url.path, status, str(exc), error_type="server_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # FastAPI's own errors (unreadable body, unknown route, wrong method) in our shapes
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"malformed JSON: the body is not UTF-8 ({exc.__cause__.reason} at byte {exc.__cause__.start})"
        elif isinstance(exc.__cause__, RecursionError):
            message = "malformed JSON: the body is nested too deeply"
        state.metrics.count_request(route_label(request.scope), exc.status_code)
        return error_response(request.url.path, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"malformed JSON: {first.get('msg', '')}"
        else:
            message = f"{field or 'body'}: {first.get('msg', 'invalid')}"
        state.metrics.count_request(route_label(request.scope), 400)
        return error_response(request.url.path, 400, message, field)

    @app.middleware("http")
    async def count(request: Request, call_next):
        try:
            response = await call_next(request)
        except Exception:   # unhandled: the client gets a 500, so /metrics counts one
            state.metrics.count_request(route_label(request.scope), 500)
            raise
        if response.status_code < 400:
            state.metrics.count_request(route_label(request.scope), response.status_code)
        return response


# the server's own routes: its banner, /metrics, the pool view and its dashboard
router = APIRouter()


@router.get("/", response_class=PlainTextResponse)
async def root():
    return PlainTextResponse("Ollama is running (pyllama-paged)")


@router.head("/", response_class=Response)
async def root_head():
    return Response()


async def _all_stats(state: ServerState) -> dict[str, dict]:
    """Each loaded model's engine figures (a model keep_alive dropped has none), the
    models read together so that one busy engine costs one timeout, not one each."""
    models = list(state.registry.models.items())
    found = await asyncio.gather(*(m.figures(state.limits.stats_timeout) for _, m in models))
    return {name: figures["stats"] for (name, _), (figures, _) in zip(models, found) if figures is not None}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    state = server_state(request)
    return PlainTextResponse(state.metrics.render(await _all_stats(state)), media_type="text/plain; version=0.0.4")


@router.get("/api/pool")
async def pool(request: Request, model: str | None = None):
    state = server_state(request)
    served = await find_model(state.registry, model)
    found, current = await served.figures(state.limits.stats_timeout)
    if found is None:   # dropped by keep_alive: no pages held (the next request loads it)
        engine = served.serving.engine
        return {"model": served.name, "paged": engine.paged, "block_size": engine.block_size,
                "blocks": [], "counts": {}, "loaded": served.is_loaded, "current": current,
                "stats": {"blocks_used": 0, "blocks_total": 0}}
    stats = found["stats"]
    counts = block_counts(stats)
    # the cells in state order, from the pool's counters (which block is which is not shown)
    blocks = [name for name in ("used", "shared", "cached", "free") for _ in range(counts[name])]
    return {"model": served.name, "paged": found["paged"], "block_size": found["block_size"],
            "blocks": blocks, "counts": counts, "stats": stats, "loaded": True, "current": current}


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard():
    return HTMLResponse(DASHBOARD_HTML)


def block_counts(stats: dict) -> dict[str, int]:
    """Blocks by dashboard state (a shared block is used, counted apart) from engine stats."""
    shared = stats.get("blocks_shared", 0)
    return {"used": stats.get("blocks_used", 0) - shared, "shared": shared,
            "cached": stats.get("blocks_cached", 0), "free": stats.get("blocks_free", 0)}


def serve(config: ServeConfig) -> None:
    """Load config's models and run uvicorn on config.host:config.port until interrupted
    (draining for config.drain_seconds first), publishing the prefix caches' changes on
    config.kv_events (a ZMQ socket) when set."""
    import uvicorn

    publisher = KVEventPublisher(config.kv_events) if config.kv_events is not None else None
    try:
        if publisher is not None:
            config = dataclasses.replace(config, kv_event_listener=publisher)
        registry = ModelRegistry(config.models, config)
        try:
            app = create_app(registry, config.limits, config.api_keys(), config.origins, config.host)
            server = uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                    timeout_graceful_shutdown=5, ssl_keyfile=config.ssl_keyfile,
                                    ssl_certfile=config.ssl_certfile)
            router_contract.DrainingServer(server, app.state.pp, config.drain_seconds).run()
        finally:
            registry.close()   # the engines' last events (their caches cleared) go out before the socket closes
    finally:
        if publisher is not None:
            publisher.close()
