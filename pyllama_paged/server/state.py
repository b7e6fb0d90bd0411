"""What a route's handler reads of the server it runs in: the ServerState the app was made
with (server/app.py), kept on the app, so that handlers are module-level functions of the
request (vLLM's api_router shape) rather than closures over a state."""

from __future__ import annotations

from fastapi import Request


def server_state(request: Request):
    """The ServerState of the app serving request: its registry, limits, metrics and prep pool."""
    return request.app.state.pp
