"""The HTTP side of pulls: small JSON documents, and blobs downloaded with HTTP Range
resume into ``<dest>.partial``, hashed as they arrive and renamed into place only
once their sha256 is the one promised (a partial file never looks complete)."""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from .._version import __version__
from ..errors import DownloadError, IntegrityError, ModelNotFoundError
from ..gguf.reader import GGUF_MAGIC
from .egress import Unreachable, open_url
from .store_files import create_new, exclusive, open_own, private_folder, remove_entry, store_bytes, sweep_stale

# progress(status, completed bytes, total bytes); total is 0 while unknown
Progress = Callable[[str, int, int], None]

USER_AGENT = f"pyllama-paged/{__version__}"
CHUNK_BYTES = 1 << 20
MAX_DOCUMENT_BYTES = 4 << 20      # a manifest is a few KB; more is not one
REPORT_EVERY_S = 0.1              # progress callbacks per second, at most (and one at the end)
MAX_BLOB_ENV = "PYLLAMA_PAGED_MAX_BLOB_BYTES"
DEFAULT_MAX_BLOB_BYTES = 512 << 30   # past the largest single-file GGUFs published (~400 GB)
STORE_BUDGET_ENV = "PYLLAMA_PAGED_STORE_MAX_BYTES"   # unset: the disk is the bound
FREE_RESERVE_BYTES = 256 << 20       # left free on the disk after a download
PLAN_DEADLINE_ENV = "PYLLAMA_PAGED_PLAN_DEADLINE_S"
DEFAULT_PLAN_DEADLINE_S = 20.0   # a manifest or a file list: kilobytes; a silent host is cut off well within 30 s
BLOB_DEADLINE_ENV = "PYLLAMA_PAGED_BLOB_DEADLINE_S"
DEFAULT_BLOB_DEADLINE_S = 300.0
MIN_RATE_ENV = "PYLLAMA_PAGED_PULL_MIN_RATE"
DEFAULT_MIN_RATE = 256 << 10         # bytes/s: slower than this a blob's deadline passes
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def sha256_hex(digest: str) -> str:
    """The hex of a "sha256:<64 hex>" digest; DownloadError for any other form."""
    m = _DIGEST.fullmatch(digest or "")
    if not m:
        raise DownloadError(f"digest {digest!r} is not sha256:<64 hex digits>")
    return m.group(1)


def file_sha256(path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 (hex) of a file, read in chunks; on_bytes(n) after each."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return h.hexdigest()


class Reporter:
    """Calls progress for one status at most every REPORT_EVERY_S (and always at the end)."""

    def __init__(self, progress: Progress | None, status: str, total: int = 0):
        self.progress, self.status, self.total = progress, status, total
        self.completed = 0
        self._last = 0.0

    def update(self, completed: int, total: int | None = None, force: bool = False) -> None:
        """Report completed of total bytes (throttled unless force)."""
        self.completed = completed
        if total is not None:
            self.total = total
        now = time.monotonic()
        if self.progress and (force or now - self._last >= REPORT_EVERY_S):
            self._last = now
            self.progress(self.status, self.completed, self.total)


def http_failure(url: str, status: int, what: str) -> DownloadError:
    """An HTTP error status as our error, saying the status only (the upstream's body is not
    repeated: it may be an internal service's answer): 404 is not-found, 401/403 a login."""
    if status == 404:
        return ModelNotFoundError(f"{what} not found ({url} answered HTTP 404)")
    if status in (401, 403):
        return DownloadError(f"{what}: {url} answered HTTP {status}; the model may be private, "
                             "and pyllama-paged does not log in to registries")
    return DownloadError(f"{what}: {url} answered HTTP {status}")


def env_number(name: str, default: float) -> float:
    """A positive number from the environment (default when unset or not one)."""
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if value > 0 else default


def max_blob_bytes() -> int:
    """The most bytes one layer may declare (MAX_BLOB_ENV, default 512 GiB)."""
    return int(env_number(MAX_BLOB_ENV, DEFAULT_MAX_BLOB_BYTES))


def check_declared_size(size: int | None, what: str) -> None:
    """StorageError for a declared size past the cap (a registry's word is not taken as is)."""
    if size is not None and size > max_blob_bytes():
        raise StorageError(f"{what} declares {size} bytes, more than the {max_blob_bytes()} a layer may have "
                           f"here ({MAX_BLOB_ENV})")


def plan_deadline() -> float:
    """Seconds a pull's planning (manifest, file list) may take in all (PLAN_DEADLINE_ENV)."""
    return env_number(PLAN_DEADLINE_ENV, DEFAULT_PLAN_DEADLINE_S)


def blob_deadline(size: int | None) -> float:
    """Seconds one blob's download may take in all: a base plus the size at the slowest rate
    accepted (BLOB_DEADLINE_ENV, MIN_RATE_ENV); a host that trickles is cut off by it."""
    base = env_number(BLOB_DEADLINE_ENV, DEFAULT_BLOB_DEADLINE_S)
    return base + (size or 0) / env_number(MIN_RATE_ENV, DEFAULT_MIN_RATE)


def get_json(url: str, what: str, headers: dict[str, str] | None = None, timeout: float = 60.0,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """A JSON object from url (a manifest), within plan_deadline() in all; DownloadError or
    ModelNotFoundError naming what, DownloadCancelled when should_stop() says so."""
    deadline = time.monotonic() + plan_deadline()
    request_headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **(headers or {})}
    host = urlsplit(url).hostname
    raw = b""
    try:
        with open_url(url, request_headers, timeout, deadline) as reply:
            if reply.status != 200:
                raise http_failure(url, reply.status, what)
            while len(raw) <= MAX_DOCUMENT_BYTES and (chunk := reply.read(64 << 10)):
                raw += chunk
                if should_stop and should_stop():
                    raise DownloadCancelled(f"{what}: the pull was stopped")
    except TimeoutError:
        raise DownloadError(f"{what}: {host} did not answer within {plan_deadline():.0f} s") from None
    except (OSError, http.client.HTTPException, Unreachable):
        raise Unreachable(f"{what}: cannot reach {host}") from None
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise DownloadError(f"{what}: {url} sent more than {MAX_DOCUMENT_BYTES} bytes; not a manifest")
    try:
        document = json.loads(raw)
    except ValueError:
        raise DownloadError(f"{what}: {url} did not send JSON") from None
    if not isinstance(document, dict):
        raise DownloadError(f"{what}: {url} sent JSON that is not an object")
    return document


class StorageError(DownloadError):
    """The store cannot take a download: a size past the cap, a full disk, the store's budget."""


class DownloadCancelled(DownloadError):
    """The caller stopped the download (its client went away); the partial file stays."""


class _Transient(Exception):
    """The connection failed or closed early: the partial file is kept and resumed."""


def _disk_full(path: Path, e: OSError) -> StorageError:
    return StorageError(f"cannot write {path.name}: {os.strerror(e.errno)}; free some space (the partial file "
                        "is kept, and the next pull resumes it)")


class _Partial:
    """<dest>.<source>.partial, open: bytes held and their running hash. Only a plain file of
    ours is resumed; anything else at that name (a link, a hard link) is replaced."""

    def __init__(self, path: Path, size: int | None):
        self.path = path
        self.fd = open_own(path)
        if self.fd is None:
            remove_entry(path)
            self.fd = create_new(path)
        self.hasher = hashlib.sha256()
        self.done = 0
        if size is not None and os.fstat(self.fd).st_size > size:
            self.restart()   # longer than the blob can be: not a prefix of it
        else:
            # the bytes kept from an earlier try are hashed again: the hash state is not saved
            while chunk := os.pread(self.fd, CHUNK_BYTES, self.done):
                self.hasher.update(chunk)
                self.done += len(chunk)
        self.resumed = self.done

    def write(self, chunk: bytes) -> None:
        """Append chunk (StorageError when the disk is full: no retry helps)."""
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(self.fd, view, self.done + len(chunk) - len(view)):]
        except OSError as e:
            if e.errno in _DISK_FULL:
                raise _disk_full(self.path, e) from None
            raise
        self.hasher.update(chunk)
        self.done += len(chunk)

    def restart(self) -> None:
        """Drop what is held (the server ignored the Range, or the prefix is wrong)."""
        os.ftruncate(self.fd, 0)
        self.hasher = hashlib.sha256()
        self.done = 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _transfer(url: str, partial: _Partial, size: int | None, report: Reporter, timeout: float, deadline: float,
              should_stop: Callable[[], bool] | None) -> None:
    """One GET from partial.done onwards, appended to the partial file."""
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if partial.done:
        headers["Range"] = f"bytes={partial.done}-"
    host = urlsplit(url).hostname
    try:
        reply = open_url(url, headers, timeout, deadline)
    except Unreachable:
        raise _Transient(f"cannot reach {host}") from None
    with reply:
        if reply.status == 416:
            if partial.done and (size is None or partial.done == size):
                return   # nothing left to send: the digest check decides
            partial.restart()
            raise _Transient(f"{host} refused the range from byte {partial.done}")
        if reply.status not in (200, 206):
            raise http_failure(url, reply.status, "blob")
        if partial.done and reply.status == 200:
            partial.restart()   # a server that ignores Range sends the whole blob again
        elif reply.status == 206:
            m = _CONTENT_RANGE.fullmatch(reply.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != partial.done:
                partial.restart()
                raise _Transient(f"{host} answered a range other than the one asked for")
        length = reply.headers.get("Content-Length")
        expected = size if size is not None else (partial.done + int(length) if length and length.isdigit()
                                                  else None)
        report.update(partial.done, expected or 0, force=True)
        try:
            while chunk := reply.read(CHUNK_BYTES):
                if expected is not None and partial.done + len(chunk) > expected:
                    raise DownloadError(f"{host} sent more than the {expected} bytes it promised")
                partial.write(chunk)
                report.update(partial.done)
                if should_stop and should_stop():
                    raise DownloadCancelled(f"download from {host} stopped at byte {partial.done}; "
                                            "the next pull resumes it")
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise DownloadError(f"the download from {host} took longer than its deadline (stopped at byte "
                                    f"{partial.done}; pull again to resume)") from None
            raise _Transient(f"{host} stopped sending at byte {partial.done}") from None
        except (OSError, http.client.HTTPException):
            raise _Transient(f"the connection to {host} failed at byte {partial.done}") from None
        if expected is not None and partial.done < expected:
            raise _Transient(f"{host} closed the connection at byte {partial.done} of {expected}")


def partial_path(dest: Path, source: str) -> Path:
    """Where a blob's download from one source is kept until it is complete: keyed by the
    source too, so bytes from one registry never seed a download from another."""
    key = hashlib.sha256(source.encode()).hexdigest()[:12]
    return dest.with_name(f"{dest.name}.{key}.partial")


def _check_space(dest: Path, partial: _Partial, size: int | None) -> None:
    """StorageError when the rest of the blob does not fit the disk or the store's budget."""
    left = max(0, (size or 0) - partial.done)
    free = shutil.disk_usage(dest.parent).free
    if left + FREE_RESERVE_BYTES > free:
        raise StorageError(f"{dest.name} needs {left} more bytes and the disk has {free} free (keeping "
                           f"{FREE_RESERVE_BYTES} in reserve)")
    budget = os.environ.get(STORE_BUDGET_ENV)
    if budget and budget.isdigit():
        used = store_bytes(dest.parent)
        if used + left > int(budget):
            raise StorageError(f"{dest.name} needs {left} more bytes and the store holds {used} of its "
                               f"{budget} ({STORE_BUDGET_ENV}; partial downloads count)")


def _present(dest: Path) -> bool:
    """Whether a complete blob is at dest: a plain file (anything else there is removed)."""
    try:
        if os.lstat(dest).st_mode & 0o170000 == 0o100000:
            return True
    except FileNotFoundError:
        return False
    remove_entry(dest)
    return False


def not_gguf(path: str | os.PathLike, what: str) -> DownloadError | None:
    """The error for a downloaded file that does not start as a GGUF does (None: it does)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        return DownloadError(f"{what}: cannot read the downloaded file: {e.strerror}")
    if head == GGUF_MAGIC:
        return None
    return DownloadError(f"{what}: the downloaded file is not a GGUF model (it starts with {head!r}, not "
                         f"{GGUF_MAGIC!r}); it was deleted and nothing was stored")


def fetch_blob(url: str, dest: Path, digest: str, size: int | None = None, *, status: str = "",
               progress: Progress | None = None, retries: int = 3, timeout: float = 60.0,
               should_stop: Callable[[], bool] | None = None, source: str = "", gguf: bool = False) -> Path:
    """Download url to dest, resuming its partial file from the same source, and verify its
    sha256 against digest ("sha256:<hex>"); gguf: the blob must also start with GGUF's magic
    (else the download is deleted). dest exists only complete and verified, so an
    existing one is kept. A connection that fails is retried (from where it stopped) up to
    retries times in a row without progress; the partial is kept for the next call when they
    run out. A resumed partial that does not hash right is dropped and fetched again once."""
    expected_hex = sha256_hex(digest)
    check_declared_size(size, f"layer {digest}")
    report = Reporter(progress, status, size or 0)
    if _present(dest):
        report.update(size if size is not None else dest.stat().st_size, force=True)
        return dest
    private_folder(dest.parent)
    sweep_stale(dest.parent)
    deadline = time.monotonic() + blob_deadline(size)
    with exclusive(dest.with_name(dest.name + ".lock")):
        if _present(dest):   # another process finished it while this one waited
            report.update(dest.stat().st_size, force=True)
            return dest
        partial = _Partial(partial_path(dest, source or url), size)
        try:
            for attempt in (1, 2):
                _check_space(dest, partial, size)
                _download(url, partial, size, report, timeout, deadline, retries, should_stop)
                report.update(partial.done, force=True)
                if partial.hasher.hexdigest() == expected_hex:
                    break
                if attempt == 1 and partial.resumed:
                    # the bytes kept from before were not this blob's: start over, once
                    partial.restart()
                    partial.resumed = 0
                    continue
                remove_entry(partial.path)
                raise IntegrityError(f"{url}: the {partial.done} bytes received have sha256 "
                                     f"{partial.hasher.hexdigest()}, not {expected_hex}; the download was deleted")
            refused = not_gguf(partial.path, f"layer {digest}") if gguf else None
            if refused is not None:
                remove_entry(partial.path)
                raise refused
            os.replace(partial.path, dest)
        finally:
            partial.close()
    return dest


def _download(url: str, partial: _Partial, size: int | None, report: Reporter, timeout: float, deadline: float,
              retries: int, should_stop: Callable[[], bool] | None) -> None:
    failures = 0
    while True:
        held = partial.done
        try:
            _transfer(url, partial, size, report, timeout, deadline, should_stop)
            return
        except _Transient as e:
            failures = 0 if partial.done > held else failures + 1
            if failures > retries:
                raise DownloadError(f"{e}; gave up after {retries} retries (pull again to resume from "
                                    f"byte {partial.done})") from None
            if time.monotonic() >= deadline:
                raise DownloadError(f"{e}; the download's deadline passed (pull again to resume from "
                                    f"byte {partial.done})") from None
            time.sleep(min(0.25 * 2 ** failures, 4.0))
