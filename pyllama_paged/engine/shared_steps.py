"""SharedSteps: one engine, many caller threads, no background thread.

A caller that needs its request to move takes the step lock, runs one step of
the whole batch and files every request's outputs with the request's owner;
the others find theirs filed when they get the lock. So concurrent callers of
one `Llama` share steps (their requests run in the same batches), the engine
is never stepped by two threads at once, and a single caller runs exactly as
if it stepped the engine itself (callbacks on its own thread, no hand-off)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Iterable

from ..errors import PagedError
from .outputs import RequestOutput


class SharedSteps:
    """Thread-safe add/abort/outputs over an engine (LLMEngine or EncoderEngine)."""

    def __init__(self, engine):
        self.engine = engine
        # Held while the engine runs a step or its requests change; a plain lock, so a
        # logits processor that calls back into the same Llama fails loudly (see _step)
        self._lock = threading.Lock()
        self._stepping: int | None = None    # the thread id inside a step
        self._filed: dict[str, deque[RequestOutput]] = {}   # request id -> outputs not yet read
        self._closed = False

    def add_request(self, prompt_ids, params, images=()):
        """Queue a request (images: as LLMEngine.add_request's); its outputs are filed for
        next_outputs until release()."""
        self._refuse_reentry()
        with self._lock:
            self._refuse_closed()
            request = self.engine.add_request(prompt_ids, params, images=images) if images else \
                self.engine.add_request(prompt_ids, params)
            if request.request_id in self.engine.requests:
                self._filed[request.request_id] = deque()
            return request

    def abort(self, request_id: str) -> None:
        """Stop a request (its pages are freed now) and drop its unread outputs."""
        self._refuse_reentry()
        with self._lock:
            if not self._closed:
                self.engine.abort(request_id)
            self._filed.pop(request_id, None)

    def call(self, fn):
        """fn(engine) between steps (stats and the like)."""
        self._refuse_reentry()
        with self._lock:
            self._refuse_closed()
            return fn(self.engine)

    def close(self, free) -> None:
        """Run free() between steps, after which every call raises PagedError: another
        thread's generation ends with an error instead of touching freed memory."""
        self._refuse_reentry()
        with self._lock:
            if not self._closed:
                self._closed = True
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                free()

    def next_outputs(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """The next outputs of any of request_ids, stepping the engine until there are
        some; [] once none of them is in flight and nothing of theirs is unread."""
        ids = list(request_ids)
        self._refuse_reentry()
        while True:
            with self._lock:
                found = []
                for request_id in ids:
                    filed = self._filed.get(request_id)
                    while filed:
                        found.append(filed.popleft())
                if found:
                    return found
                self._refuse_closed()
                if not any(request_id in self.engine.requests for request_id in ids):
                    for request_id in ids:
                        self._filed.pop(request_id, None)
                    return []
                self._step()
            # A plain lock is not fair: retaken at once, a busy CPU would never let the callers
            # waiting to add their requests in, and each request would run alone. Yield first.
            time.sleep(0)

    def _step(self) -> None:
        """One step (caller holds the lock); outputs filed with their owners."""
        self._stepping = threading.get_ident()
        try:
            outputs = self.engine.step()
        except Exception as e:  # the step's requests fail; the engine and other callers go on
            outputs = []
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
                outputs.append(RequestOutput(request_id, finished=True,
                                             error=f"engine step failed: {type(e).__name__}: {e}"))
        finally:
            self._stepping = None
        for out in outputs:
            filed = self._filed.get(out.request_id)
            if filed is not None:
                filed.append(out)

    def _refuse_closed(self) -> None:
        if self._closed:
            raise PagedError("this Llama is closed")

    def _refuse_reentry(self) -> None:
        if self._stepping == threading.get_ident():
            raise PagedError("a callback running inside a step (logits processor, stopping criteria) "
                             "may not use the same Llama")
