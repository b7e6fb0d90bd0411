"""The store's files and folders, made so that whoever else can write near them cannot turn
the server's writes against another file: folders created 0700 and refused when another user
owns them or group/other may write them (SHARED_ENV opts a deliberate group setup in), files
created new with O_EXCL|O_NOFOLLOW (or mkstemp) and 0600, an existing file opened with
O_NOFOLLOW and used only if it is a plain file of ours with one link, and files left by a
pull that hung up (partials, locks) removed once they are old and nobody holds them."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

from ..errors import DownloadError

SHARED_ENV = "PYLLAMA_PAGED_SHARED_STORE"
STALE_HOURS_ENV = "PYLLAMA_PAGED_STALE_PARTIAL_HOURS"
DEFAULT_STALE_HOURS = 24.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
log = logging.getLogger("pyllama_paged.models")


class UnsafeStoreError(DownloadError):
    """A store folder another account could write into (or a file where one was expected)."""


def shared() -> bool:
    """Whether the operator set up a store shared by a group (SHARED_ENV=1)."""
    return os.environ.get(SHARED_ENV, "").strip().lower() in ("1", "true", "yes")


def file_mode() -> int:
    """The mode of new store files: 0600, or 0660 in a shared group store."""
    return 0o660 if shared() else 0o600


def folder_problem(path: Path) -> str | None:
    """Why path is no safe store folder (None: it is): not a folder, another user's, or
    writable by group/other. A shared store (SHARED_ENV) may be group-writable by one of our
    groups and owned by any of its members, never writable by others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder (a link or a file stands there)"
    if shared():
        if st.st_mode & stat.S_IWOTH:
            return f"{path} is writable by every account (mode {st.st_mode & 0o7777:o})"
        if st.st_uid != os.geteuid() and st.st_gid not in os.getgroups() + [os.getegid()]:
            return f"{path} belongs to another user and a group this account is not in"
        return None
    if st.st_uid != os.geteuid():
        return (f"{path} belongs to another user (uid {st.st_uid}); for a store shared by a group, "
                f"set {SHARED_ENV}=1 (see docs/models.md)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by group or other (mode {st.st_mode & 0o7777:o}); chmod 700 it, or set "
                f"{SHARED_ENV}=1 for a store shared by a group (see docs/models.md)")
    return None


def private_folder(path: Path) -> Path:
    """path as a folder made for the store (0700, or 02770 in a shared store), after checking
    an existing one; UnsafeStoreError when it is not safe."""
    mode = 0o2770 if shared() else 0o700
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)
            os.chmod(path, mode)   # the umask narrowed the setgid and group bits
    problem = folder_problem(path)
    if problem:
        raise UnsafeStoreError(f"the model store is not safe to use: {problem}")
    return path


def create_new(path: Path) -> int:
    """A new file's descriptor (read-write); never through a link or over an existing file."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, file_mode())


def open_own(path: Path) -> int | None:
    """An existing file's descriptor (read-write) if it is a plain file of ours with one link;
    None when there is none or it is anything else (the caller replaces it)."""
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM):
            return None
        raise
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    return None


def remove_entry(path: Path) -> None:
    """Unlink what stands at path (a link itself, never its target); folders are left."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)


def write_new(path: Path, data: bytes) -> None:
    """Replace path with data atomically: a fresh mkstemp file (O_EXCL, 0600) renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def exclusive(path: Path, blocking: bool = True):
    """Hold the lock file at path (created if missing; never through a link). Yields True when
    held, False when another holds it and blocking is False."""
    try:
        import fcntl
    except ImportError:   # not POSIX: no lock, a clash costs a failed digest check at worst
        yield True
        return
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, file_mode())
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            remove_entry(path)   # a planted link: the lock is ours to make
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafeStoreError(f"{path} is not a plain file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            # a stale-lock sweep may have unlinked the file meanwhile: hold the one at the path
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                continue
            yield True
            return
        finally:
            os.close(fd)


def stale_seconds() -> float:
    """How old an unheld partial or lock must be to go (STALE_HOURS_ENV, default 24 h)."""
    try:
        return float(os.environ.get(STALE_HOURS_ENV) or DEFAULT_STALE_HOURS) * 3600
    except ValueError:
        return DEFAULT_STALE_HOURS * 3600


def lock_of(partial: Path) -> Path:
    """The lock file that guards a partial ('<digest>.<source>.partial' -> '<digest>.lock')."""
    return partial.with_name(partial.name.split(".", 1)[0] + ".lock")


def sweep_stale(blobs: Path, now: float | None = None) -> int:
    """Remove the partials and locks older than stale_seconds() that no pull holds; how many."""
    if not blobs.is_dir():
        return 0
    cutoff = (now or time.time()) - stale_seconds()
    removed = 0
    for entry in sorted(blobs.iterdir()):
        if not entry.name.endswith((".partial", ".lock")):
            continue
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            continue
        if st.st_mtime > cutoff:
            continue
        lock = entry if entry.name.endswith(".lock") else lock_of(entry)
        try:
            with exclusive(lock, blocking=False) as held:
                if held:
                    remove_entry(entry)
                    if entry != lock:
                        remove_entry(lock)
                    removed += 1
        except OSError as e:
            log.warning("cannot sweep %s: %s", entry, e)
    return removed


def store_bytes(blobs: Path) -> int:
    """Bytes of every file in a blobs folder (complete blobs and partials)."""
    total = 0
    if blobs.is_dir():
        for entry in blobs.iterdir():
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(entry)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total
