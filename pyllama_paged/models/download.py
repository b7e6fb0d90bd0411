"""The HTTP side of pulls: small JSON documents, and blobs downloaded with HTTP Range
resume into ``<dest>.partial``, hashed as they arrive and renamed into place only
once their sha256 is the one promised (a partial file never looks complete)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from .._version import __version__
from ..errors import DownloadError, IntegrityError, ModelNotFoundError

# progress(status, completed bytes, total bytes); total is 0 while unknown
Progress = Callable[[str, int, int], None]

USER_AGENT = f"pyllama-paged/{__version__}"
CHUNK_BYTES = 1 << 20
MAX_DOCUMENT_BYTES = 4 << 20      # a manifest is a few KB; more is not one
REPORT_EVERY_S = 0.1              # progress callbacks per second, at most (and one at the end)
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


def _http_failure(url: str, error: urllib.error.HTTPError, what: str) -> DownloadError:
    """An HTTP error status as our error: 404 is not-found, 401/403 need a login we lack."""
    detail = ""
    with contextlib.suppress(Exception):
        body = json.loads(error.read(64 << 10) or b"{}")
        errors = body.get("errors") if isinstance(body, dict) else None
        if errors and isinstance(errors[0], dict):   # the registry API's error list
            detail = f": {errors[0].get('message') or errors[0].get('code')}"
        elif isinstance(body, dict) and isinstance(body.get("error"), str):
            detail = f": {body['error']}"
    if error.code == 404:
        return ModelNotFoundError(f"{what} not found ({url} answered HTTP 404{detail})")
    if error.code in (401, 403):
        return DownloadError(f"{what}: {url} answered HTTP {error.code}{detail}; the model may be private, "
                             "and pyllama-paged does not log in to registries")
    return DownloadError(f"{what}: {url} answered HTTP {error.code} {error.reason}{detail}")


def get_json(url: str, what: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> dict:
    """A JSON object from url (a manifest); DownloadError/ModelNotFoundError naming what."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read(MAX_DOCUMENT_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise _http_failure(url, e, what) from None
    except (OSError, http.client.HTTPException) as e:
        raise DownloadError(f"{what}: cannot reach {url} ({e})") from None
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise DownloadError(f"{what}: {url} sent more than {MAX_DOCUMENT_BYTES} bytes; not a manifest")
    try:
        document = json.loads(raw)
    except ValueError as e:
        raise DownloadError(f"{what}: {url} did not send JSON ({e})") from None
    if not isinstance(document, dict):
        raise DownloadError(f"{what}: {url} sent JSON that is not an object")
    return document


class _Transient(Exception):
    """The connection failed or closed early: the partial file is kept and resumed."""


class _Partial:
    """The state of <dest>.partial: bytes held and their running hash."""

    def __init__(self, path: Path, size: int | None):
        self.path = path
        self.hasher = hashlib.sha256()
        self.done = 0
        if path.exists():
            if size is not None and path.stat().st_size > size:
                self.restart()   # longer than the blob can be: not a prefix of it
            else:
                # the bytes kept from an earlier try are hashed again: the hash state is not saved
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK_BYTES):
                        self.hasher.update(chunk)
                        self.done += len(chunk)

    def restart(self) -> None:
        """Drop what is held (the server ignored the Range, or the prefix is wrong)."""
        self.path.write_bytes(b"")
        self.hasher = hashlib.sha256()
        self.done = 0


@contextlib.contextmanager
def _exclusive(path: Path):
    """One downloader per blob across processes (a second pull waits, then finds it done)."""
    try:
        import fcntl
    except ImportError:   # not POSIX: no lock, a clash costs a failed digest check at worst
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _transfer(url: str, partial: _Partial, size: int | None, report: Reporter, timeout: float,
              should_stop: Callable[[], bool] | None) -> None:
    """One GET from partial.done onwards, appended to the partial file."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    if partial.done:
        request.add_header("Range", f"bytes={partial.done}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and partial.done and (size is None or partial.done == size):
            return   # nothing left to send: the digest check decides
        if e.code == 416:
            refused = f"{url} refused the range from byte {partial.done}"
            partial.restart()
            raise _Transient(refused) from None
        raise _http_failure(url, e, "blob") from None
    except (OSError, http.client.HTTPException) as e:
        raise _Transient(f"cannot reach {url} ({e})") from None
    with response:
        if partial.done and response.status == 200:
            partial.restart()   # a server that ignores Range sends the whole blob again
        elif response.status == 206:
            m = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != partial.done:
                partial.restart()
                raise _Transient(f"{url} answered a range other than the one asked for")
        length = response.headers.get("Content-Length")
        expected = size if size is not None else (partial.done + int(length) if length else None)
        report.update(partial.done, expected or 0, force=True)
        with open(partial.path, "ab") as f:
            try:
                while chunk := response.read(CHUNK_BYTES):
                    if expected is not None and partial.done + len(chunk) > expected:
                        raise DownloadError(f"{url} sent more than the {expected} bytes it promised")
                    f.write(chunk)
                    partial.hasher.update(chunk)
                    partial.done += len(chunk)
                    report.update(partial.done)
                    if should_stop and should_stop():
                        raise DownloadCancelled(f"download of {url} stopped at byte {partial.done}; "
                                                "the next pull resumes it")
            except (OSError, http.client.HTTPException) as e:
                raise _Transient(f"connection to {url} failed at byte {partial.done} ({e})") from None
        if expected is not None and partial.done < expected:
            raise _Transient(f"{url} closed the connection at byte {partial.done} of {expected}")


class DownloadCancelled(DownloadError):
    """The caller stopped the download (its client went away); the partial file stays."""


def fetch_blob(url: str, dest: Path, digest: str, size: int | None = None, *, status: str = "",
               progress: Progress | None = None, retries: int = 3, timeout: float = 60.0,
               should_stop: Callable[[], bool] | None = None) -> Path:
    """Download url to dest, resuming dest.partial, and verify its sha256 against digest
    ("sha256:<hex>"). dest exists only complete and verified, so an existing one is kept.
    A connection that fails is retried (from where it stopped) up to retries times in a row
    without progress; the partial file is kept for the next call when they run out."""
    expected_hex = sha256_hex(digest)
    report = Reporter(progress, status, size or 0)
    if dest.exists():
        report.update(size if size is not None else dest.stat().st_size, force=True)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.with_name(dest.name + ".lock")):
        if dest.exists():   # another process finished it while this one waited
            report.update(dest.stat().st_size, force=True)
            return dest
        partial = _Partial(dest.with_name(dest.name + ".partial"), size)
        failures = 0
        while True:
            held = partial.done
            try:
                _transfer(url, partial, size, report, timeout, should_stop)
                break
            except _Transient as e:
                failures = 0 if partial.done > held else failures + 1
                if failures > retries:
                    raise DownloadError(f"{e}; gave up after {retries} retries (pull again to resume from "
                                        f"byte {partial.done})") from None
                time.sleep(min(0.25 * 2 ** failures, 4.0))
        report.update(partial.done, force=True)
        if partial.hasher.hexdigest() != expected_hex:
            partial.path.unlink(missing_ok=True)
            raise IntegrityError(f"{url}: the {partial.done} bytes received have sha256 "
                                 f"{partial.hasher.hexdigest()}, not {expected_hex}; the download was deleted")
        os.replace(partial.path, dest)
    return dest
