"""The HTTP server: app factory, API-key and body-size guards, error shapes,
metrics, the live block-pool dashboard, and `serve`."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from .dashboard import DASHBOARD_HTML
from .generation import APIError, Limits
from .metrics import Metrics
from .registry import EngineOptions, ModelRegistry
from ..server import embeddings_api, ollama_api, ollama_manage, openai_api


@dataclass
class ServerState:
    registry: ModelRegistry
    limits: Limits
    metrics: Metrics
    api_key: str | None = None


def _is_openai(path: str) -> bool:
    return path.startswith("/v1/")


def error_response(path: str, status: int, message: str, param: str | None = None,
                   error_type: str = "invalid_request_error", headers: dict | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error shape under /v1, Ollama's {"error": ...} elsewhere."""
    if _is_openai(path):
        body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


class GuardMiddleware:
    """API key on every route (when set) and a cap on request body size."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if self.state.api_key:
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not given:
                query = scope.get("query_string", b"").decode()
                given = next((p[4:] for p in query.split("&") if p.startswith("key=")), "")
            if not hmac.compare_digest(given.encode(), self.state.api_key.encode()):
                resp = error_response(path, 401, "invalid or missing API key", None, "invalid_request_error",
                                      code="invalid_api_key")
                return await resp(scope, receive, send)
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            # Ollama's own examples post JSON with curl -d (form content type): parse it as JSON
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        limit = self.state.limits.max_body_bytes
        if int(headers.get("content-length", "0") or 0) > limit:
            resp = error_response(path, 413, f"request body larger than {limit} bytes")
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
                    raise HTTPException(413, f"request body larger than {limit} bytes")
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
                if served.expired(now):
                    await served.unload_if_idle()

    async def start():
        tasks.append(asyncio.get_running_loop().create_task(watch()))

    async def stop():
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)


def create_app(registry: ModelRegistry, limits: Limits | None = None, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving the registry's models."""
    state = ServerState(registry, limits or Limits(), Metrics(), api_key)
    app = FastAPI(title="pyllama-paged", version="0.1.0")
    app.state.pp = state
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        state.metrics.count_request(request.url.path, exc.status)
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.type, exc.headers,
                              exc.code)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # FastAPI's own errors (unreadable body, unknown route, wrong method) in our shapes
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"malformed JSON: the body is not UTF-8 ({exc.__cause__.reason} at byte {exc.__cause__.start})"
        # an unknown path is not a metrics label (one per probed URL would grow without bound)
        route = request.url.path if request.scope.get("route") else "(unmatched)"
        state.metrics.count_request(route, exc.status_code)
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
        state.metrics.count_request(request.url.path, 400)
        return error_response(request.url.path, 400, message, field)

    @app.middleware("http")
    async def count(request: Request, call_next):
        try:
            response = await call_next(request)
        except Exception:   # unhandled: the client gets a 500, so /metrics counts one
            state.metrics.count_request(request.url.path, 500)
            raise
        if response.status_code < 400:
            state.metrics.count_request(request.url.path, response.status_code)
        return response

    _expire_idle_models(app, registry)
    app.include_router(ollama_api.build_router(state))
    app.include_router(ollama_manage.build_router(state))
    app.include_router(openai_api.build_router(state))
    app.include_router(embeddings_api.build_router(state))

    @app.get("/", response_class=PlainTextResponse)
    async def root():
        return PlainTextResponse("Ollama is running (pyllama-paged)")

    @app.head("/", response_class=Response)
    async def root_head():
        return Response()

    async def all_stats() -> dict[str, dict]:
        """Each loaded model's engine figures (a model keep_alive dropped has none)."""
        found = {name: await m.call_if_loaded(lambda llm: llm.stats()) for name, m in registry.models.items()}
        return {name: stats for name, stats in found.items() if stats is not None}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(state.metrics.render(await all_stats()),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/api/pool")
    async def pool(model: str | None = None):
        served = registry.get(model)
        if served is None:
            raise APIError(404, f"model '{model}' not found", "model")

        def snapshot(llm):
            kv = llm.runner.kv
            states = []
            if kv.paged:
                for b in range(kv.num_blocks):
                    info = kv.pool.block_info(b)
                    states.append("shared" if info.ref_count > 1 else info.state.name.lower())
            else:
                states = ["used"] * kv.num_in_use + ["free"] * (kv.num_blocks - kv.num_in_use)
            return {"model": served.name, "paged": kv.paged, "block_size": kv.block_size,
                    "blocks": states, "stats": llm.stats()}

        found = await served.call_if_loaded(snapshot)
        if found is None:   # dropped by keep_alive: no pages held (the next request loads it)
            return {"model": served.name, "paged": served.options.paged, "block_size": served.options.block_size,
                    "blocks": [], "loaded": False, "stats": {"blocks_used": 0, "blocks_total": 0}}
        return {**found, "loaded": True}

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(DASHBOARD_HTML)

    _document_errors(app)
    return app


def serve(model_paths: list[str] | None, host: str, port: int, api_key: str | None,
          options: EngineOptions, limits: Limits) -> None:
    """Load the models and run uvicorn until interrupted."""
    import uvicorn

    registry = ModelRegistry(model_paths, options)
    app = create_app(registry, limits, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        registry.close()
