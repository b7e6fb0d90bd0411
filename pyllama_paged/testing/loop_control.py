"""Holding an EngineLoop still, and turning hangs into failures, for tests that
must order events without relying on timing."""

import contextlib
import threading


@contextlib.contextmanager
def paused(loop):
    """Hold the loop thread inside a call, so that commands queue up behind it."""
    inside, release = threading.Event(), threading.Event()

    def hold(llm):
        inside.set()
        release.wait()

    holder = threading.Thread(target=loop.call, args=(hold,))
    holder.start()
    inside.wait()
    try:
        yield
    finally:
        release.set()
        holder.join()


def finishes(fn, timeout=120):
    """fn()'s result, run on a thread; the deadline only turns a hang into a failure."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    if "error" in box:
        raise box["error"]
    return box.get("value")
