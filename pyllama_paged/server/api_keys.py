"""The API keys a server accepts: those given when it started (`--api-key`, repeatable, or
PYLLAMA_API_KEY) and those of a key file (`--api-key-file`: one key a line, `#` comments),
read again whenever the file changes, so that a team adds and revokes keys without a restart."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

from ..errors import PagedError


def read_key_file(path: str) -> tuple[bytes, ...]:
    """The keys of a key file: each line stripped, blank lines and `#` comments left out;
    OSError when it cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = (line.strip() for line in f)
        return tuple(line.encode() for line in lines if line and not line.startswith("#"))


def _identity(path: str) -> tuple | None:
    """What tells one version of the file from another (a rewrite, an editor's replacement);
    None when there is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class APIKeys:
    """The keys a request may carry. A key file that cannot be read any more (removed,
    unreadable) gives no keys: a revocation by deleting the file fails closed, never open."""

    def __init__(self, keys: Iterable[str] = (), path: str | None = None):
        self.given = tuple(k.encode() for k in keys if k)
        self.path = path
        self._seen: tuple | None = None
        self._from_file: tuple[bytes, ...] = ()
        if path is not None:
            try:
                self._from_file = read_key_file(path)
            except OSError as e:
                raise PagedError(f"--api-key-file {path}: {e.strerror or e}") from None
            self._seen = _identity(path)

    @classmethod
    def of(cls, keys: "APIKeys | str | Iterable[str] | None") -> "APIKeys":
        """keys as APIKeys: an APIKeys as it is, one key, several, or None (no key required)."""
        if isinstance(keys, APIKeys):
            return keys
        if keys is None:
            return cls()
        return cls([keys] if isinstance(keys, str) else list(keys))

    @property
    def required(self) -> bool:
        """Whether a request must carry a key (one was given, or a key file was named)."""
        return bool(self.given) or self.path is not None

    def _file_keys(self) -> tuple[bytes, ...]:
        """The key file's keys as it is now (read again only when it changed)."""
        seen = _identity(self.path)
        if seen != self._seen:
            try:
                self._from_file = read_key_file(self.path) if seen is not None else ()
            except OSError:
                self._from_file = ()
            self._seen = seen
        return self._from_file

    def accepts(self, given: str) -> bool:
        """Whether given is one of the keys (compared in constant time, each key in turn)."""
        candidate = given.encode("latin-1", "replace")
        keys = self.given + (self._file_keys() if self.path is not None else ())
        # every key compared, so that the time taken does not say which key came close
        return bool(candidate) and sum(hmac.compare_digest(candidate, k) for k in keys) > 0
