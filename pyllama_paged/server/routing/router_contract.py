"""What a router in front of several servers relies on (vllm-router, llm-d, Dynamo and
the like), beside the OpenAI routes: GET /health (200 while the server can take work,
503 while it drains or an engine has died), POST /reset_prefix_cache, and a uvicorn
server that drains before it stops: on the first SIGTERM or SIGINT /health turns 503
while requests are still served for drain_seconds, so routers stop sending work before
the port closes (a second signal stops it at once)."""

from __future__ import annotations

import logging
import threading

import uvicorn
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..state import server_state

log = logging.getLogger("pyllama_paged.server")


def unhealthy_reason(state) -> str | None:
    """Why the server cannot take work now, or None when it can."""
    if state.draining:
        return "the server is draining: it finishes its requests and stops"
    dead = [m.name for m in state.registry.models.values() if m.loop is not None and not m.loop.is_alive]
    if dead:
        return f"the engine of {', '.join(dead)} has stopped"
    return None


def log_reset(name: str, done: dict) -> None:
    """Say what a prefix-cache reset of one model dropped and what it kept."""
    kept = done.get("disk_tier_kept")
    log.info("prefix cache of %s reset: pool cleared, %d blocks dropped from the RAM tier%s", name,
             done.get("ram_tier_blocks", 0),
             f"; the disk tier {kept} is kept (shared with other servers and restarts; delete the "
             "directory while no server uses it to drop it)" if kept else "")


router = APIRouter()   # /health and /reset_prefix_cache, as vLLM's servers answer them
# an empty 200 (vLLM's answer), documented as such: no JSON body to promise
_EMPTY = {"response_class": Response, "responses": {200: {"description": "empty body", "content": {}}}}


@router.get("/health", **_EMPTY)
async def health(request: Request):
    reason = unhealthy_reason(server_state(request))
    # vLLM answers 200 with an empty body; routers read only the status
    return Response(status_code=200) if reason is None else JSONResponse({"error": reason}, status_code=503)


@router.head("/health", **_EMPTY)
async def health_head(request: Request):
    return Response(status_code=200 if unhealthy_reason(server_state(request)) is None else 503)


@router.post("/reset_prefix_cache", **_EMPTY)
async def reset_prefix_cache(request: Request):
    """Drop every loaded model's cached prefixes, in the pool and the RAM tier (running
    requests keep their pages); a disk tier is kept, and the log says so."""
    for served in list(server_state(request).registry.models.values()):
        done = await served.call_if_loaded(lambda llm: None if llm.is_encoder else llm.reset_prefix_cache())
        if done:
            log_reset(served.name, done)
    return Response(status_code=200)   # vLLM's answer: routers read only the status


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on the first exit signal marks the state draining and keeps
    serving for drain_seconds before it shuts down as usual."""

    def __init__(self, config: uvicorn.Config, state, drain_seconds: float = 0.0):
        super().__init__(config)
        self.state = state
        self.drain_seconds = drain_seconds
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        """First signal: drain (health 503), then exit; a later one: uvicorn's own handling."""
        self.state.draining = True
        if self.drain_seconds > 0 and self._timer is None:
            log.info("draining for %.1f s: /health answers 503, requests are still served", self.drain_seconds)
            self._timer = threading.Timer(self.drain_seconds, self._stop)
            self._timer.daemon = True
            self._timer.start()
            return
        super().handle_exit(sig, frame)

    def _stop(self) -> None:
        self.should_exit = True   # uvicorn's main loop checks it every tick
