"""EngineLoop: the LLMEngine on a background thread, for many callers.
Callers on any thread submit requests and read their outputs from a
RequestStream (an iterator and an async iterator); abort frees the pages at
once. The loop sleeps on a condition variable when there is no work."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import deque

from .errors import PagedError
from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams

_END = object()


class RequestStream:
    """Outputs of one request as they are produced."""

    def __init__(self, loop: "EngineLoop", request_id: str):
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.Queue = queue.Queue()
        self._async_targets: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._lock = threading.Lock()
        self.finished = False

    def _put(self, item) -> None:
        with self._lock:
            self._queue.put(item)
            for aloop, aqueue in self._async_targets:
                aloop.call_soon_threadsafe(aqueue.put_nowait, item)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self):
        aqueue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            # replay what already arrived, then receive new items directly
            while True:
                try:
                    aqueue.put_nowait(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._async_targets.append((asyncio.get_running_loop(), aqueue))
        while True:
            item = await aqueue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self) -> None:
        """Stop the request; its pages are freed by the loop right away."""
        self._loop.abort(self.request_id)


class EngineLoop:
    """Runs an LLMEngine while there is work; thread-safe submit and abort."""

    def __init__(self, llm: LLMEngine):
        self.llm = llm
        self._cv = threading.Condition()
        self._adds: deque = deque()
        self._aborts: deque = deque()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pyllama-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queue a request from any thread; returns its stream of RequestOutput."""
        params.validate()
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id)
        with self._cv:
            if self._stopped:
                raise PagedError("the engine loop is stopped")
            self._streams[request_id] = stream
            self._adds.append((request_id, list(prompt_ids), params))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort from any thread (a no-op for finished requests)."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def call(self, fn):
        """Run fn(llm) on the loop thread between steps and return its result (stats, ...)."""
        done = threading.Event()
        box = {}

        def task():
            try:
                box["value"] = fn(self.llm)
            except Exception as e:  # handed back to the caller
                box["error"] = e
            done.set()

        with self._cv:
            self._adds.append(task)
            self._cv.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        """Finish the thread; pending streams end with an error."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._adds or self._aborts or self._stopped or self.llm.has_work()):
                    self._cv.wait()
                if self._stopped:
                    break
                adds, self._adds = self._adds, deque()
                aborts, self._aborts = self._aborts, deque()
            for request_id in aborts:
                self.llm.abort(request_id)
                self._close(request_id, None)
            for item in adds:
                if callable(item):
                    item()
                    continue
                request_id, prompt_ids, params = item
                try:
                    request = self.llm.add_request(prompt_ids, params, request_id)
                except Exception as e:  # a bad request fails itself; the thread must live on
                    self._close(request_id, PagedError(f"request {request_id} could not start: {e}"))
                    continue
                if request.error:
                    self._deliver(RequestOutput(request_id, finished=True, error=request.error,
                                                num_prompt_tokens=len(prompt_ids)))
            if not self.llm.has_work():
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:  # a step failure fails its requests, not the process
                for request_id in list(self.llm.requests):
                    self.llm.abort(request_id)
                    self._close(request_id, PagedError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out)
        for request_id in list(self._streams):
            self._close(request_id, PagedError("the engine loop stopped"))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            self._close(out.request_id, None)

    def _close(self, request_id: str, error: BaseException | None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if error is not None:
                stream._put(error)
            stream.finished = True
            stream._put(_END)
