"""A time budget for Python work that runs code we do not control (a pulled model's chat
template): past its deadline the work is interrupted where it stands.

A thread cannot be killed, but CPython lets one thread raise an exception in another at
that thread's next bytecode boundary (``PyThreadState_SetAsyncExc``). Jinja compiles a
template to Python bytecode, so even a loop that calls nothing (nested ``range``s with an
empty body) is interrupted; a template cannot catch the exception, since templates have no
``try``. A single C call that never returns to bytecode (one huge string operation) would
not be, which is why the sandbox also caps the sizes such operations may produce."""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class BudgetExceeded(BaseException):
    """Raised inside the interrupted thread. A BaseException, so that no ``except
    Exception`` on the way (Jinja's, a filter's) swallows it."""


def _raise_in(thread_id: int) -> bool:
    """Ask CPython to raise BudgetExceeded in thread_id; True if it was found."""
    found = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(BudgetExceeded))
    if found > 1:   # more than one thread state matched: undo, as the C API asks
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
        return False
    return found == 1


def run_within(seconds: float | None, work: Callable[[], T]) -> T:
    """work() in this thread, or BudgetExceeded once it has run for seconds (None: no limit)."""
    if seconds is None:
        return work()
    thread_id = threading.get_ident()
    guard = threading.Lock()
    state = {"running": True, "fired": False}

    def interrupt() -> None:
        with guard:
            if state["running"]:
                state["fired"] = _raise_in(thread_id)

    timer = threading.Timer(seconds, interrupt)
    timer.daemon = True
    timer.start()
    try:
        try:
            return work()
        finally:
            with guard:
                state["running"] = False
            timer.cancel()
            if state["fired"]:
                # The exception is pending if work() ended between the timer's check and its
                # delivery: let it land here, inside this frame, never in the caller's code.
                for _ in range(100):
                    pass
    except BudgetExceeded:
        if not state["fired"]:
            raise
        raise BudgetExceeded(f"ran past its budget of {seconds:g} s") from None
