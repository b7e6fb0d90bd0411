"""Ollama's model-management routes: pull (a download into the store, or nothing for a
file this server was started with), copy and create (names for a served model), delete
(of such a name, or of a stored model and its files), push (refused), and the shapes
/api/tags, /api/show and /api/ps describe a model with."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ...tools.reasoning import template_thinks
from ..generation import APIError
from ..lookup import find_model, model_not_found
from ..state import server_state
from ..registry import quantization_level
from .pull import pull_response

# IDE clients refuse Ollama servers older than 0.6.4; we answer the API of this release
OLLAMA_VERSION = "0.12.6"


class NameRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    name: str | None = None
    stream: bool | None = True
    insecure: bool | None = None


class CopyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    source: str
    destination: str


def describe(served, name: str | None = None) -> dict[str, Any]:
    """A model as /api/tags lists it."""
    return {"name": name or served.name, "model": name or served.name,
            "modified_at": dt.datetime.fromtimestamp(served.loaded_at, dt.timezone.utc).isoformat(),
            "size": served.size, "digest": served.digest, "details": served.details()}


def describe_stored(stored) -> dict[str, Any]:
    """A stored model that is not loaded, as /api/tags lists it (facts from its manifest)."""
    details = dict(stored.details)
    file_type = details.pop("file_type", None)
    details["quantization_level"] = quantization_level(file_type) if file_type is not None else ""
    name = stored.name.lower()
    return {"name": name, "model": name,
            "modified_at": dt.datetime.fromtimestamp(stored.pulled_at, dt.timezone.utc).isoformat(),
            "size": stored.size, "digest": stored.digest.split(":", 1)[-1], "details": details}


def _capabilities(served) -> list[str]:
    """What Ollama's clients may ask of the model (a template that thinks: "thinking" too)."""
    if served.config.is_encoder:
        return ["embedding"]
    thinks = served.template is not None and template_thinks(served.template.source)
    return ["completion", "tools"] + (["thinking"] if thinks else []) + (["vision"] if served.vision else [])


def show_model(served) -> dict[str, Any]:
    """/api/show: the context reported is the one this server runs, not the training one."""
    cfg = served.config
    info = {k: v.encode("utf-8", "replace").decode("utf-8") if isinstance(v, str) else v
            for k, v in served.metadata.items() if not k.startswith("tokenizer.ggml.")}
    info[f"{cfg.arch}.context_length"] = served.n_ctx
    return {"modelfile": f"FROM {served.path}\n", "parameters": f"num_ctx {served.n_ctx}",
            "template": served.template.source if served.template else "", "details": served.details(),
            "model_info": info, "capabilities": _capabilities(served),
            "kv_bytes_per_token": served.kv_bytes_per_token,
            "context_length": served.n_ctx, "architecture": cfg.arch,
            "modified_at": dt.datetime.fromtimestamp(served.loaded_at, dt.timezone.utc).isoformat()}


def _statuses(stream: bool | None, steps: list[str]):
    if stream is False:
        return JSONResponse({"status": "success"})
    lines = [json.dumps({"status": s}) + "\n" for s in steps + ["success"]]
    return StreamingResponse(iter(lines), media_type="application/x-ndjson")


router = APIRouter()


@router.post("/api/pull")
async def pull(body: NameRequest, request: Request):
    registry = server_state(request).registry
    name = body.model or body.name or ""
    if not name:
        raise APIError(400, "model: a model name to pull is required", "model")
    served = registry.served(name)
    if served is not None and registry.is_startup_name(name):
        # a file this server was started with (or a name for one): nothing to fetch
        return _statuses(body.stream, ["pulling manifest", f"pulling {served.digest[:12]}",
                                       "verifying sha256 digest", "writing manifest"])
    return await pull_response(name, body.stream, registry.store, request)


@router.post("/api/push")
async def push(body: NameRequest):
    raise APIError(400, "pushing models to a registry is not supported by this server", "model")


@router.post("/api/copy")
async def copy(body: CopyRequest, request: Request):
    registry = server_state(request).registry
    await find_model(registry, body.source, "source")
    try:
        registry.add_alias(body.destination, body.source)
    except ValueError as e:
        raise APIError(400, str(e), "destination") from None
    return JSONResponse(None)


@router.delete("/api/delete")
async def delete(body: NameRequest, request: Request):
    registry = server_state(request).registry
    name = body.model or body.name or ""
    if registry.remove_alias(name):
        return JSONResponse(None)
    if registry.is_startup_name(name):
        # the name means what a request with it gets: the file, though the store may have one too
        raise APIError(400, f"model '{name}' is a file this server was started with; it is not deleted "
                       "(names made with copy or create, and pulled models, can be)", "model")
    stored = registry.store.find_name(name) if name else None
    if stored is None:
        raise model_not_found(registry, name)
    try:
        await registry.delete_stored(stored)
    except ValueError as e:
        raise APIError(400, str(e), "model") from None
    return JSONResponse(None)


@router.post("/api/create")
async def create(body: dict[str, Any], request: Request):
    registry = server_state(request).registry
    name = body.get("model") or body.get("name")
    source = body.get("from")
    if not isinstance(name, str) or not name:
        raise APIError(400, "model: a name for the new model is required", "model")
    unsupported = sorted(k for k in body if k not in ("model", "name", "from", "stream"))
    if unsupported or not isinstance(source, str):
        raise APIError(400, "only creating a new name 'from' a served model is supported "
                       f"(not {', '.join(unsupported) or 'without from'})", unsupported[0] if unsupported else "from")
    await find_model(registry, source, "from")
    try:
        registry.add_alias(name, source)
    except ValueError as e:
        raise APIError(400, str(e), "model") from None
    return _statuses(body.get("stream"), [f"using existing model {source}"])

