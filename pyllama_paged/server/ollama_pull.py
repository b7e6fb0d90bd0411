"""/api/pull for real: the reference is planned first (so an unknown model is a 404, a
bad name a 400, an unreachable source a 502, before anything streams), then fetched
into the store on a thread while Ollama's NDJSON statuses stream out with byte counts.
A client that goes away stops the download; its partial file stays for the next pull."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import DownloadError, ModelNotFoundError, PagedError, RequestError
from ..models.pull import plan_pull
from ..models.refs import parse_reference
from ..models.store import ModelStore
from .generation import APIError

# pulls in flight and the events that stop them (the loop holds tasks only weakly)
IN_FLIGHT: dict[asyncio.Task, threading.Event] = {}


def status_code(error: PagedError) -> int:
    """The HTTP status of a pull's failure."""
    if isinstance(error, ModelNotFoundError):
        return 404
    if isinstance(error, RequestError):
        return 400
    return 502 if isinstance(error, DownloadError) else 500


def _event(status: str, completed: int, total: int, digests: dict[str, str]) -> dict[str, Any]:
    """One NDJSON object: a layer's "pulling <digest12>" carries its digest and byte counts."""
    short = status.removeprefix("pulling ")
    if status.startswith("pulling ") and short in digests:
        return {"status": status, "digest": digests[short], "total": total, "completed": completed}
    return {"status": status}


async def pull_response(name: str, stream: bool | None, store: ModelStore):
    """The response to /api/pull of name (a model reference)."""
    try:
        ref = parse_reference(name)
        plan = await asyncio.to_thread(plan_pull, ref)
    except PagedError as e:
        raise APIError(status_code(e), f"pull model manifest: {e}", "model") from None
    digests = {digest.split(":", 1)[-1][:12]: digest for digest, _ in plan.layers}
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def progress(status: str, completed: int, total: int) -> None:
        loop.call_soon_threadsafe(events.put_nowait, _event(status, completed, total, digests))

    async def run() -> None:
        try:
            await asyncio.to_thread(plan.fetch, store, progress, stop.is_set)
            events.put_nowait({"status": "success"})
        except PagedError as e:
            events.put_nowait({"error": str(e), "code": status_code(e)})
        finally:
            events.put_nowait(None)

    runner = loop.create_task(run())
    IN_FLIGHT[runner] = stop
    runner.add_done_callback(lambda task: IN_FLIGHT.pop(task, None))
    if stream is False:
        try:
            await asyncio.shield(runner)
        except asyncio.CancelledError:   # the client went away
            stop.set()
            raise
        last: dict = {}
        while (event := events.get_nowait()) is not None:
            last = event
        if "error" in last:
            raise APIError(last["code"], last["error"], "model")
        return JSONResponse({"status": "success"})

    async def lines():
        try:
            yield json.dumps({"status": "pulling manifest"}) + "\n"
            while (event := await events.get()) is not None:
                event.pop("code", None)   # mid-stream the status line is already sent: Ollama's {"error"}
                yield json.dumps(event) + "\n"
        finally:
            stop.set()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
