"""/api/pull for real: the reference is planned first (so an unknown model is a 404, a
bad name a 400, an unreachable source a 502, before anything streams), then fetched
into the store on a thread while Ollama's NDJSON statuses stream out with byte counts.
A client that goes away stops the download; its partial file stays for the next pull.

Pulls run on threads of their own (never asyncio's default executor, which listings and
engine calls share), at most MAX_PULLS_ENV at a time: one more is answered 503 at once,
so a host that never answers holds a bounded number of threads and nothing else waits."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from ...errors import DownloadError, ModelNotFoundError, PagedError, RequestError
from ...models.download import DownloadCancelled, StorageError, plan_deadline
from ...models.pull import plan_pull
from ...models.refs import parse_reference
from ...models.store import ModelStore
from ...models.store_files import UnsafeStoreError
from ..generation import APIError

MAX_PULLS_ENV = "PYLLAMA_PAGED_MAX_PULLS"
DEFAULT_MAX_PULLS = 4
THREADS = 16   # the executor's size; the cap (MAX_PULLS_ENV) is what admits a pull
DISCONNECT_POLL_S = 0.25

# pulls in flight and the events that stop them (the loop holds tasks only weakly)
IN_FLIGHT: dict[asyncio.Task, threading.Event] = {}
_executor = ThreadPoolExecutor(THREADS, thread_name_prefix="pyllama-pull")
_admitted = 0   # pulls holding a place (planning or fetching); changed on the event loop only


def max_pulls() -> int:
    """How many pulls may run at once (MAX_PULLS_ENV, default 4, at most THREADS)."""
    try:
        value = int(os.environ.get(MAX_PULLS_ENV) or DEFAULT_MAX_PULLS)
    except ValueError:
        value = DEFAULT_MAX_PULLS
    return max(1, min(value, THREADS))


def status_code(error: PagedError) -> int:
    """The HTTP status of a pull's failure."""
    if isinstance(error, ModelNotFoundError):
        return 404
    if isinstance(error, RequestError):
        return 400
    if isinstance(error, (StorageError, UnsafeStoreError)):
        return 507
    return 502 if isinstance(error, DownloadError) else 500


def _event(status: str, completed: int, total: int, digests: dict[str, str]) -> dict[str, Any]:
    """One NDJSON object: a layer's "pulling <digest12>" carries its digest and byte counts."""
    short = status.removeprefix("pulling ")
    if status.startswith("pulling ") and short in digests:
        return {"status": status, "digest": digests[short], "total": total, "completed": completed}
    return {"status": status}


class _Place:
    """One of the MAX_PULLS places, held from planning to the fetch's end (release once)."""

    def __init__(self):
        global _admitted
        if _admitted >= max_pulls():
            raise APIError(503, f"{_admitted} pulls are in progress, the most this server runs at once "
                           f"({MAX_PULLS_ENV}); try again when one has finished", "model")
        _admitted += 1
        self.held = True
        self.until: asyncio.Future | None = None

    def release(self) -> None:
        """Give the place back, or once `until` (a thread still winding down) is done."""
        global _admitted
        if self.until is not None and not self.until.done():
            self.until.add_done_callback(lambda _: self.release())
            return
        if self.held:
            self.held = False
            _admitted -= 1


async def _plan(ref, stop: threading.Event, request, place: _Place):
    """plan_pull on the pull threads, within the planning deadline, stopped when the client
    goes away (the thread sees stop at its next read and ends; its place is given back then)."""
    loop = asyncio.get_running_loop()
    planning = loop.run_in_executor(_executor, plan_pull, ref, stop.is_set)
    place.until = planning
    deadline = loop.time() + plan_deadline()
    try:
        while True:
            done, _ = await asyncio.wait({planning}, timeout=DISCONNECT_POLL_S)
            if done:
                return planning.result()
            if request is not None and await request.is_disconnected():
                raise DownloadCancelled("the client went away while the pull was being planned")
            if loop.time() > deadline:
                raise DownloadError(f"planning the pull took longer than {plan_deadline():.0f} s")
    finally:
        if not planning.done():
            stop.set()
            planning.add_done_callback(_retrieve)


def _retrieve(future) -> None:
    if not future.cancelled():
        future.exception()


async def pull_response(name: str, stream: bool | None, store: ModelStore, request=None):
    """The response to /api/pull of name (a model reference); request (when given) is
    watched so that a client that goes away while the pull is planned stops it."""
    place = _Place()
    stop = threading.Event()
    try:
        try:
            ref = parse_reference(name)
            plan = await _plan(ref, stop, request, place)
        except PagedError as e:
            raise APIError(status_code(e), f"pull model manifest: {e}", "model") from None
    except BaseException:
        place.release()
        raise
    digests = {digest.split(":", 1)[-1][:12]: digest for digest, _ in plan.layers}
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def progress(status: str, completed: int, total: int) -> None:
        loop.call_soon_threadsafe(events.put_nowait, _event(status, completed, total, digests))

    async def run() -> None:
        try:
            await loop.run_in_executor(_executor, plan.fetch, store, progress, stop.is_set)
            events.put_nowait({"status": "success"})
        except PagedError as e:
            events.put_nowait({"error": str(e), "code": status_code(e)})
        except OSError as e:   # the store's folder or files (not the network: that is a DownloadError)
            events.put_nowait({"error": f"the model store: {e.strerror or e}", "code": 500})
        finally:
            place.release()
            events.put_nowait(None)

    runner = loop.create_task(run())
    IN_FLIGHT[runner] = stop
    runner.add_done_callback(lambda task: IN_FLIGHT.pop(task, None))
    if stream is False:
        try:
            while not (await asyncio.wait({runner}, timeout=DISCONNECT_POLL_S))[0]:
                if request is not None and await request.is_disconnected():
                    stop.set()   # the download stops at its next chunk; its partial stays
                    return JSONResponse({"error": "the client went away"}, status_code=499)
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
