"""Chat templates rendered out of harm's way: a small pool of renderer processes.

Any GGUF's template is untrusted input (a pulled model is anyone's), and one Jinja
operation is one C call that holds the GIL until it returns: squaring a huge number, or
padding a string to a gigabyte, stalled every stream of the server for seconds and grew
its memory without bound. So a template renders in a renderer process (the script
`template_sandbox.py`, which imports only Jinja): its address space is capped
(RLIMIT_AS), its CPU time bounded per render (RLIMIT_CPU, a backstop), and the server
waits for each render at most `seconds` of wall-clock time, then kills the process and
starts another. A render's request carries only plain data (the template source and its
variables); the answer comes back as UTF-8 text of at most `output_bytes`, never as a
pickle. Each process keeps the templates it compiled, so a warm one renders in about a
millisecond.

Our own built-in templates (the source is one of chat_template's constants) are code of
this package: they render in this process. `RenderLimits(in_process=True)` (or
PYLLAMA_PAGED_TEMPLATE_RENDERER=in-process) renders every template in this process, with
the bounded sandbox and the time budget of `render_budget` only: for a template you trust
where processes cannot be started.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ..errors import PagedError
from . import template_sandbox as sandbox
from .render_budget import BudgetExceeded, run_within

RENDERER_ENV = "PYLLAMA_PAGED_TEMPLATE_RENDERER"   # "in-process": every template renders in this process
_SCRIPT = Path(sandbox.__file__)
_STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class RenderLimits:
    """How chat templates are rendered: each render within seconds (wall clock), in one of
    at most `processes` renderer processes whose address space is memory_mib, returning at
    most output_bytes of prompt. in_process renders in this process instead (trusted
    templates only: no memory limit, and a single C call cannot be interrupted)."""

    seconds: float = 5.0
    memory_mib: int = 512
    output_bytes: int = 8 << 20
    processes: int = 2
    in_process: bool = False

    def __post_init__(self):
        if not self.seconds > 0 or self.memory_mib < 64 or self.output_bytes < 1 or self.processes < 1:
            raise PagedError(f"template renderer limits out of range: {self} (seconds > 0, memory_mib >= 64, "
                             "output_bytes >= 1, processes >= 1)")


def render_error(kind: bytes, message: str, limits: RenderLimits) -> PagedError:
    """The error a failed render becomes (one wording whichever way it was rendered)."""
    if kind == sandbox.RAISED:
        return PagedError(f"chat template: {message}")
    if kind == sandbox.OUT_OF_MEMORY:
        return PagedError(f"chat template ran out of memory while rendering (a renderer process may use "
                          f"{limits.memory_mib} MiB); the renderer process was replaced")
    if kind == sandbox.TOO_BIG:
        return PagedError(f"chat template rendered a prompt of {message} bytes, more than the "
                          f"{limits.output_bytes} a prompt may have")
    return PagedError(f"chat template failed to render: {message}")


def _timed_out(limits: RenderLimits, replaced: bool) -> PagedError:
    tail = "; its renderer process was stopped and replaced" if replaced else ""
    return PagedError(f"chat template did not finish rendering within {limits.seconds:g} s (the model's "
                      f"template loops too long for these messages){tail}")


class _Lost(Exception):
    """The renderer process is of no further use (timed out, died, or sent too much)."""

    def __init__(self, error: PagedError):
        super().__init__(str(error))
        self.error = error


def _child_env() -> dict:
    """The environment of a renderer process: ours, with Jinja's folders first on its path
    (the process starts without site's user folders being needed)."""
    import markupsafe

    folders = [str(Path(m.__file__).resolve().parent.parent) for m in (jinja2, markupsafe)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(folders + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p]))
    return env


class _Process:
    """One renderer process and the two pipes to it."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        if not sys.executable:
            raise PagedError("cannot start a chat template renderer process (no Python executable is known); "
                             f"set {RENDERER_ENV}=in-process to render trusted templates in this process")
        # -P: the script's folder (the package's tokenizer/) is not put on its path (Python 3.11+)
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        try:
            self.proc = subprocess.Popen(
                [sys.executable, *safe_path, str(_SCRIPT), str(limits.memory_mib << 20), str(limits.output_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True, env=_child_env(),
                start_new_session=True)   # not in the terminal's group: Ctrl-C stops the server, which stops it
        except OSError as e:
            raise PagedError(f"cannot start a chat template renderer process: {e}") from None
        self.to_child, self.from_child = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.to_child, False)
        os.set_blocking(self.from_child, False)

    @property
    def pid(self) -> int:
        """The process's id."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def run(self, job: bytes, deadline: float) -> tuple[bytes, str]:
        """(reply kind, text) of one job; _Lost when the process cannot answer by deadline."""
        self._send(sandbox._FRAME.pack(len(job)) + job, deadline)
        head = self._receive(sandbox._FRAME.size, deadline)
        size = sandbox._FRAME.unpack(head)[0]
        if size > self.limits.output_bytes + 64:
            raise _Lost(render_error(sandbox.TOO_BIG, f"more than {size - 1}", self.limits))
        reply = self._receive(size, deadline)
        return reply[:1], reply[1:].decode("utf-8", "surrogatepass")

    def _wait(self, fd: int, writing: bool, deadline: float) -> None:
        left = deadline - time.monotonic()
        ready = select.select([], [fd], [], max(0.0, left)) if writing else select.select([fd], [], [], max(0.0, left))
        if not any(ready):
            raise _Lost(_timed_out(self.limits, True))

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.to_child, True, deadline)
            try:
                view = view[os.write(self.to_child, view):]
            except BlockingIOError:
                continue
            except OSError:   # a broken pipe: the process ended
                raise _Lost(self._died()) from None

    def _receive(self, n: int, deadline: float) -> bytes:
        parts, left = [], n
        while left:
            self._wait(self.from_child, False, deadline)
            try:
                chunk = os.read(self.from_child, min(left, 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise _Lost(self._died())
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def _died(self) -> PagedError:
        try:
            status = self.proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            status = None
        how = f"signal {-status}" if status is not None and status < 0 else f"exit status {status}"
        return PagedError(f"chat template renderer process ended while rendering ({how}; a limit of "
                          f"{self.limits.memory_mib} MiB of memory and the render's CPU time applies); "
                          "the renderer process was replaced")

    def stop(self) -> None:
        """Kill the process and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class RenderPool:
    """Up to limits.processes renderer processes, started on demand and kept warm; a render
    waits for a free one. A process that overruns a render's budget, runs out of memory,
    dies or sends more than a prompt may have is killed and replaced at once."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self._idle: list[_Process] = []
        self._count = 0          # processes started and not yet retired
        self._cond = threading.Condition()
        self._closed = False
        self.replaced = 0        # processes killed or lost and started again
        self.pid_owner = os.getpid()

    def render(self, source: str, variables: dict) -> str:
        """The template's text for these variables; PagedError saying what went wrong."""
        try:
            cpu_seconds = math.ceil(self.limits.seconds) + 1
            job = pickle.dumps((source, variables, cpu_seconds), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:   # an object of the caller's that is no plain data
            raise PagedError(f"chat template inputs cannot be sent to the renderer process: {e}") from None
        process = self._acquire()
        try:
            kind, text = process.run(job, time.monotonic() + self.limits.seconds)
        except _Lost as lost:
            self._replace(process)
            raise lost.error from None
        except BaseException:
            self._replace(process)
            raise
        if kind == sandbox.OUT_OF_MEMORY:
            self._replace(process)
        else:
            self._release(process)
        if kind != sandbox.OK:
            raise render_error(kind, text, self.limits)
        return text

    def warm(self) -> None:
        """Start one process now (a server's first chat then finds it ready)."""
        with self._cond:
            if self._count or self._closed:
                return
            self._count += 1
        self._add_new()

    def pids(self) -> list[int]:
        """The ids of the renderer processes idle now (each a child of this process)."""
        with self._cond:
            return [p.pid for p in self._idle]

    def _acquire(self) -> _Process:
        with self._cond:
            while True:
                if self._closed:
                    raise PagedError("the chat template renderers are shut down")
                while self._idle:
                    process = self._idle.pop()
                    if process.alive():
                        return process
                    process.stop()   # died while idle (killed from outside): its place is free
                    self._count -= 1
                    self.replaced += 1
                if self._count < self.limits.processes:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            return _Process(self.limits)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _release(self, process: _Process) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(process)
                self._cond.notify()
                return
            self._count -= 1
        process.stop()

    def _replace(self, process: _Process) -> None:
        """Kill process and put a fresh one in its place (its start overlaps the caller's error)."""
        process.stop()
        with self._cond:
            self.replaced += 1
            if self._closed:
                self._count -= 1
                self._cond.notify()
                return
        self._add_new()

    def _add_new(self) -> None:
        """A new process into the idle list, for a place already counted."""
        try:
            fresh = _Process(self.limits)
        except PagedError:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            return
        self._release(fresh)

    def close(self) -> None:
        """Stop the idle processes now, and each busy one when its render returns."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for process in idle:
            process.stop()


class InProcessRenderer:
    """Templates rendered in this process: the bounded sandbox and a time budget, but no
    memory limit, and a single C call is not interrupted (trusted templates only)."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self._env = sandbox.environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self._lock = threading.Lock()

    def render(self, source: str, variables: dict) -> str:
        """The template's text for these variables; PagedError saying what went wrong."""
        with self._lock:
            template = self._compiled.get(source)
        try:
            if template is None:
                template = self._env.from_string(source)
                with self._lock:
                    self._compiled[source] = template
            return run_within(self.limits.seconds, lambda: template.render(**variables))
        except BudgetExceeded:
            raise _timed_out(self.limits, False) from None
        except sandbox.TemplateRaised as e:
            raise render_error(sandbox.RAISED, str(e), self.limits) from None
        except jinja2.TemplateError as e:
            raise render_error(sandbox.FAILED, str(e), self.limits) from e

    def close(self) -> None:
        """Nothing to stop (the pool's counterpart)."""


_lock = threading.Lock()
_shared: dict = {}   # "limits", "pool", "trusted": this process's renderers


def render_limits(**settings) -> RenderLimits:
    """RenderLimits with these settings, rendering in this process if RENDERER_ENV says so."""
    in_process = os.environ.get(RENDERER_ENV, "").strip().lower() in ("in-process", "in_process")
    return RenderLimits(**{"in_process": in_process, **settings})


def configure(limits: RenderLimits, warm: bool = False) -> None:
    """Render this process's chat templates under limits from now on (renders in flight
    finish under the old ones); warm: start a renderer process now."""
    with _lock:
        old = _shared.get("pool") if _shared.get("limits") != limits else None
        if _shared.get("limits") != limits:
            _shared.clear()
            _shared["limits"] = limits
    if old is not None:
        old.close()
    if warm and not limits.in_process:
        renderer().warm()


def limits() -> RenderLimits:
    """The limits this process renders chat templates under."""
    with _lock:
        if "limits" not in _shared:
            _shared["limits"] = render_limits()
        return _shared["limits"]


def renderer() -> RenderPool | InProcessRenderer:
    """This process's renderer of untrusted templates (created on first use)."""
    current = limits()
    with _lock:
        pool = _shared.get("pool")
        if pool is None or getattr(pool, "pid_owner", os.getpid()) != os.getpid():
            pool = InProcessRenderer(current) if current.in_process else RenderPool(current)
            _shared["pool"] = pool
        return pool


def trusted_renderer() -> InProcessRenderer:
    """The renderer of this package's own templates: in this process, under the time budget."""
    current = limits()
    with _lock:
        trusted = _shared.get("trusted")
        if trusted is None:
            trusted = _shared["trusted"] = InProcessRenderer(current)
        return trusted


def _forget_after_fork() -> None:
    # a forked child shares its parent's pipes: it must never write to the parent's renderers
    # (and the lock may have been held by a thread the child does not have)
    global _lock
    _lock = threading.Lock()
    _shared.pop("pool", None)


def _close_at_exit() -> None:
    pool = _shared.get("pool")
    if isinstance(pool, RenderPool) and pool.pid_owner == os.getpid():
        pool.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_close_at_exit)
