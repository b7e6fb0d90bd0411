"""The same rules for huggingface_hub's requests as for ours (models.egress): while a pull runs
on a thread, every request its Hub client makes there, each redirect included, is checked
against the allowed hosts and addresses, and stops once the pull's deadline passes or its
client went away. Other uses of huggingface_hub in the process are left alone.

NOTE(hub_guard): huggingface_hub connects by itself, so the address checked here is resolved
again by its client; files it fetches through Xet (hf_xet) bypass this hook."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from ..errors import DownloadError
from .download import DownloadCancelled
from .egress import check_url

_current = threading.local()   # the pull running on this thread: (deadline, should_stop)
_installed = threading.Lock()
_done = False


def check_now() -> None:
    """DownloadError / DownloadCancelled when this thread's pull is past its deadline or stopped."""
    guard = getattr(_current, "guard", None)
    if guard is None:
        return
    deadline, should_stop = guard
    if time.monotonic() > deadline:
        raise DownloadError("the Hub did not finish within the pull's deadline (pull again to go on)")
    if should_stop is not None and should_stop():
        raise DownloadCancelled("the pull was stopped")


def _check_request(request) -> None:
    if getattr(_current, "guard", None) is None:
        return
    check_url(str(request.url))
    check_now()


def _install() -> None:
    """Add the check to the client huggingface_hub builds (once per process)."""
    global _done
    with _installed:
        if _done:
            return
        from huggingface_hub.utils import set_client_factory
        from huggingface_hub.utils._http import default_client_factory

        def factory():
            client = default_client_factory()
            hooks = dict(client.event_hooks)
            hooks["request"] = [*hooks.get("request", []), _check_request]
            client.event_hooks = hooks
            return client

        set_client_factory(factory)
        _done = True


@contextlib.contextmanager
def guarded(seconds: float, should_stop: Callable[[], bool] | None = None):
    """Run the Hub calls inside under the egress rules, a deadline and should_stop."""
    _install()
    previous = getattr(_current, "guard", None)
    _current.guard = (time.monotonic() + seconds, should_stop)
    try:
        yield
    finally:
        _current.guard = previous
