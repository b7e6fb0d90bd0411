"""EngineLoop: the LLMEngine on a background thread, for many callers.
Callers on any thread submit requests and read their outputs from a
RequestStream (an iterator and an async iterator); abort frees the pages at
once. The loop sleeps on a condition variable when there is no work."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections import deque

from ..errors import PagedError
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .params import SamplingParams

_END = object()


def _settle(future: concurrent.futures.Future, value=None, error: BaseException | None = None) -> None:
    """Give a task's future its outcome unless the caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass   # cancelled: nobody is waiting


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
    """Runs an LLMEngine while there is work; thread-safe submit and abort.

    Submits, aborts and calls are carried out in the order they were made, so
    an abort that follows its submit always finds the request. A failure in
    one of them is reported to its caller only; if the loop itself ever dies,
    every stream and waiting call gets the error and later calls raise."""

    def __init__(self, llm: LLMEngine):
        self.llm = llm
        self._cv = threading.Condition()
        self._commands: deque = deque()   # ("add", id, prompt, params, images) | ("abort", id) | ("call", fn, box, done) | ("task", work, future)
        self._streams: dict[str, RequestStream] = {}
        self._tasks: list[tuple] = []     # (generator, Future): long work run a piece per step
        self._ids = itertools.count()
        self._stopped = False
        self._death: str | None = None    # why the loop thread ended, if not by stop()
        self._thread = threading.Thread(target=self._run, name="pyllama-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """Whether the loop still serves: False once stopped or dead."""
        return self._thread.is_alive() and not self._stopped

    def _enqueue(self, command: tuple) -> None:
        """Queue a command for the loop thread; the caller holds self._cv."""
        if self._stopped:
            raise PagedError(f"the engine loop is stopped{': ' + self._death if self._death else ''}")
        self._commands.append(command)
        self._cv.notify()

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None, images=()) -> RequestStream:
        """Queue a request from any thread; returns its stream of RequestOutput. images: as
        LLMEngine.add_request's."""
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id)
        with self._cv:
            if request_id in self._streams:
                raise PagedError(f"request id {request_id!r} is already in flight")
            self._enqueue(("add", request_id, list(prompt_ids), params, list(images)))
            self._streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Abort from any thread (a no-op for finished requests or a stopped loop)."""
        with self._cv:
            if not self._stopped:
                self._enqueue(("abort", request_id))

    def call(self, fn):
        """Run fn(llm) on the loop thread between steps and return its result (stats, ...)."""
        done = threading.Event()
        box: dict = {}
        with self._cv:
            self._enqueue(("call", fn, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def run_in_steps(self, work) -> concurrent.futures.Future:
        """Run work(llm), a generator function, on the loop thread one piece (up to its next
        yield) at a time with a step of everyone's requests between pieces, so long work
        (prompt scoring) never freezes the streams. The future gets its return value or
        error; cancelling the future closes the generator (its finally frees what it held)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._enqueue(("task", work, future))
        return future

    def stop(self) -> None:
        """Finish the thread; pending streams and calls end with an error."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
            reason = "the engine loop stopped"
        except BaseException as e:  # a bug in the loop: nobody may be left waiting
            reason = f"the engine loop failed: {type(e).__name__}: {e}"
            with self._cv:
                self._death = reason
        with self._cv:
            self._stopped = True
            commands, self._commands = self._commands, deque()
        for command in commands:
            if command[0] == "call":
                command[2]["error"] = PagedError(reason)
                command[3].set()
            elif command[0] == "task":
                _settle(command[2], error=PagedError(reason))
        for generator, future in self._tasks:
            generator.close()
            _settle(future, error=PagedError(reason))
        self._tasks = []
        for request_id in list(self._streams):
            self._close(request_id, PagedError(reason))

    def _serve_once(self) -> bool:
        """Carry out the queued commands, then one step; False once stopped."""
        with self._cv:
            while not (self._commands or self._stopped or self.llm.has_work() or self._tasks):
                self._cv.wait()
            if self._stopped:
                return False
            commands, self._commands = self._commands, deque()
        for command in commands:
            self._carry_out(command)
        self._advance_tasks()
        if not self.llm.has_work():
            return True
        try:
            outputs = self.llm.step()
        except Exception as e:  # a step failure fails its requests, not the process
            for request_id in list(self.llm.requests):
                self.llm.abort(request_id)
                self._close(request_id, PagedError(f"engine step failed: {e}"))
            return True
        for out in outputs:
            self._deliver(out)
        return True

    def _advance_tasks(self) -> None:
        """One piece of each long task; finished, failed and cancelled ones leave."""
        still = []
        for generator, future in self._tasks:
            if future.cancelled():
                generator.close()
                continue
            try:
                next(generator)
            except StopIteration as done:
                _settle(future, value=done.value)
                continue
            except Exception as e:  # handed back to the caller
                _settle(future, error=e)
                continue
            still.append((generator, future))
        self._tasks = still

    def _carry_out(self, command: tuple) -> None:
        kind = command[0]
        if kind == "task":
            _, work, future = command
            # the future stays pending until settled, so the caller can cancel it meanwhile
            if not future.cancelled():
                try:
                    self._tasks.append((work(self.llm), future))
                except Exception as e:  # handed back to the caller
                    _settle(future, error=e)
        elif kind == "call":
            _, fn, box, done = command
            try:
                box["value"] = fn(self.llm)
            except Exception as e:  # handed back to the caller
                box["error"] = e
            done.set()
        elif kind == "abort":
            request_id = command[1]
            try:
                self.llm.abort(request_id)
                self._close(request_id, None)
            except Exception as e:  # reported to that request's stream only
                self._close(request_id, PagedError(f"abort failed: {e}"))
        else:
            _, request_id, prompt_ids, params, images = command
            try:
                request = self.llm.add_request(prompt_ids, params, request_id, images=images) if images else \
                    self.llm.add_request(prompt_ids, params, request_id)
                error = request.error
            except Exception as e:  # a bad request fails alone
                self.llm.abort(request_id)
                error = str(e) if isinstance(e, PagedError) else f"{type(e).__name__}: {e}"
            if error:
                self._deliver(RequestOutput(request_id, finished=True, error=error,
                                            num_prompt_tokens=len(prompt_ids)))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            self._close(out.request_id, None)

    def _close(self, request_id: str, error: BaseException | None) -> None:
        with self._cv:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            if error is not None:
                stream._put(error)
            stream.finished = True
            stream._put(_END)
