"""Stores for KV blocks below the pool: bytes by content key, nothing else. A key
names one block's K and V in every layer (the prefix tier derives it from the
model, the KV layout, the chain of tokens up to that block and, for a disk tier,
the directory's secret); a store keeps the bytes and gives them back, or says it
has none. Two stores:

- HostBlockStore: process memory, bounded bytes, least recently used first out.
- DiskBlockStore: one directory, one file per block, named by its key.

The directory is treated as reachable by someone hostile (another account, a
careless script), so:

- it is created 0700 and, if it exists, refused unless this account owns it and
  nobody else may write it (or, opted in with `group=True`, unless it belongs to
  one of this account's groups and others have no access: docs/prefix-tiers.md);
  a symbolic link is refused, and an existing directory is made private (chmod)
  only if it is one this package made (it holds the secret below): a typo such
  as `~` is refused, never locked;
- every operation goes through a descriptor of the directory opened and checked
  once, so renaming the path away and planting another one changes nothing;
- files are created under fresh random names with O_CREAT|O_EXCL|O_NOFOLLOW, mode
  0600 (0660 in group mode), then renamed into place (a reader sees a whole file
  or none); a planted symlink is never opened (O_NOFOLLOW, lstat first), only
  removed or replaced;
- a read compares the file's length with the block's expected length before it
  reads a byte, then reads with pread into a buffer (never mmap: a file truncated
  under the reader is a short read, and a short read is a miss, not SIGBUS);
- file names are keyed by a random secret kept in the directory (created once with
  O_EXCL, readable only by whoever may use the directory), so a name says nothing
  of the prompt to whoever cannot read the secret;
- the bound is the directory's, not one process's: the bytes are counted in a
  shared file under an flock, and whoever takes it past the bound evicts the oldest
  files, whichever process wrote them;
- a block is not written while its filesystem has less than a reserve free (the
  save is counted as skipped): a cache never fills the disk others need.

Several processes may share the directory: a file another process removes,
truncates or corrupts is a miss (and is deleted), never an exception or wrong bytes.
Neither store knows of models, pools or the engine."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import secrets
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from ...errors import PagedError

log = logging.getLogger("pyllama_paged.engine")

KEY_BYTES = 16
SECRET_BYTES = 32
# magic, key, payload bytes, crc32 of the payload, crc32 of the header before it
_HEADER = struct.Struct(f"<8s{KEY_BYTES}sQII")
_MAGIC = b"PPKVBLK1"
_SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
SECRET_NAME = ".pyllama-kv-secret"
LOCK_NAME = ".pyllama-kv-lock"      # the flock, and the directory's byte count in its first 8 bytes
_COUNT = struct.Struct("<Q")
_STALE_TEMPORARY_SECONDS = 3600
# the disk writer's backlog: beyond this many bytes waiting, new blocks are dropped (the
# engine never waits on the disk; a dropped block is recomputed if it is ever missed)
_WRITE_BACKLOG_BYTES = 256 << 20
# bytes left free on the directory's filesystem: below it no block is written (as pulls keep)
DEFAULT_RESERVE_BYTES = 256 << 20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# a FIFO planted under an entry's name would block a plain open for reading forever
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class HostBlockStore:
    """Blocks in host RAM, at most max_bytes of them, least recently used evicted first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.num_bytes = 0
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes (now the most recently used), or None."""
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def touch(self, key: bytes) -> bool:
        """Mark a block used now; False if the store does not hold it."""
        if key not in self._blocks:
            return False
        self._blocks.move_to_end(key)
        return True

    def put(self, key: bytes, data: np.ndarray) -> None:
        """Keep a block (the store owns data from here), evicting the oldest past max_bytes."""
        if data.nbytes > self.max_bytes:
            return
        old = self._blocks.pop(key, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        self._blocks[key] = data
        self.num_bytes += data.nbytes
        while self.num_bytes > self.max_bytes:
            _, gone = self._blocks.popitem(last=False)
            self.num_bytes -= gone.nbytes
            self.num_evicted += 1

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.num_bytes = 0


# ---- the directory ---------------------------------------------------------------
def _modes(group: bool) -> tuple[int, int]:
    """(directory mode, file mode): private to this account, or shared with the directory's group."""
    return (0o2770, 0o660) if group else (0o700, 0o600)


def _unusable(path: str, why: str) -> PagedError:
    return PagedError(f"the prefix cache directory {path} cannot be used: {why}")


def open_directory(directory: str, group: bool = False) -> int:
    """A descriptor of directory, created if needed (0700; 2770 with group), checked to be
    private to this account (or, with group, to one of its groups); PagedError saying why
    not. A symbolic link is refused. A directory this account owns that others may only
    read is made 0700 if this package made it (it holds the secret), else refused."""
    path = os.path.abspath(directory)
    dir_mode, _ = _modes(group)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, dir_mode)
            created = True
        except FileExistsError:
            created = False
        if os.path.islink(path):
            raise _unusable(path, f"it is a symbolic link (to {os.readlink(path)}); give the directory itself")
        # O_NOFOLLOW: a link put there since the check is not followed either
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as e:
        raise _unusable(path, e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
        if created:
            os.fchmod(fd, dir_mode)   # mkdir's mode went through the umask
            st = os.fstat(fd)
        _check_directory_owner(fd, path, st, group)
    except OSError as e:
        os.close(fd)
        raise _unusable(path, e.strerror or str(e)) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_directory_owner(fd: int, path: str, st: os.stat_result, group: bool) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if group:
        if st.st_gid != os.getegid() and st.st_gid not in os.getgroups():
            raise _unusable(path, f"with group sharing, its group (gid {st.st_gid}) must be one of this "
                                  "account's groups")
        if mode & 0o007:
            raise _unusable(path, f"with group sharing, other accounts must have no access (mode {mode:04o}; "
                                  "chmod 2770 it)")
        return
    if st.st_uid != os.geteuid():
        raise _unusable(path, f"it belongs to uid {st.st_uid}, not to this account (uid {os.geteuid()}); to share "
                              "a directory between accounts use group sharing (docs/prefix-tiers.md)")
    if mode & 0o022:
        # someone else could have planted files already: nothing in it can be trusted
        raise _unusable(path, f"others may write in it (mode {mode:04o}); use a fresh directory, or chmod 700 "
                              "it if nobody else can have written there")
    if mode & 0o077:
        if not _made_here(fd):
            # not ours to lock: a typo (`~`, a shared folder) must not take others' access away
            raise _unusable(path, f"others may read it (mode {mode:04o}) and it is not a prefix cache directory "
                                  "pyllama-paged made; give a new directory (it is created 0700), or chmod 700 "
                                  "this one yourself")
        os.fchmod(fd, 0o700)
        log.warning("prefix cache directory %s was mode %04o (others could read the cached K/V); now 0700",
                    path, mode)


def _made_here(dir_fd: int) -> bool:
    """Whether the directory holds this package's secret file, a plain file of this account:
    a prefix cache directory made by an earlier run (earlier versions made them 0755)."""
    try:
        st = os.stat(SECRET_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def check_directory(directory: str, group: bool = False) -> None:
    """Create directory if needed and check that it is safe to use and that files can be
    written there; PagedError saying why not."""
    fd = open_directory(directory, group)
    try:
        tmp_fd, name = _create_temporary(fd, _modes(group)[1])
        os.close(tmp_fd)
        os.unlink(name, dir_fd=fd)
    except OSError as e:
        raise _unusable(os.path.abspath(directory), e.strerror or str(e)) from None
    finally:
        os.close(fd)


def _create_temporary(dir_fd: int, mode: int) -> tuple[int, str]:
    """A new file under a random name nobody could have planted anything at (O_EXCL:
    whatever exists there, a symlink included, is never opened), with exactly mode."""
    for _ in range(16):
        name = f".{secrets.token_hex(12)}{_TMP_SUFFIX}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode,
                         dir_fd=dir_fd)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, mode)   # the umask may have taken group bits group mode needs
            st = os.fstat(fd)
            if mode & 0o070:
                dir_gid = os.fstat(dir_fd).st_gid
                if st.st_gid != dir_gid:
                    os.fchown(fd, -1, dir_gid)
        except OSError:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
            raise
        return fd, name
    raise FileExistsError("no free temporary name")


def _open_regular(dir_fd: int, name: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result] | None:
    """(descriptor, its stat) of name if it is a regular file, never following a symlink;
    None if it is missing; ValueError if something else (a symlink, a FIFO) is there."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(before.st_mode):
        raise ValueError(f"{name} is not a regular file")
    try:
        fd = os.open(name, flags | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:   # ELOOP: swapped for a symlink since the lstat
        raise ValueError(f"{name}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise ValueError(f"{name} changed while it was opened")
    return fd, st


def read_exact(fd: int, nbytes: int, offset: int) -> np.ndarray | None:
    """nbytes of fd from offset into a new buffer, or None if the file ends first (it was
    truncated meanwhile: a miss, never a signal)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:   # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, nbytes - done, offset + done)
            n = len(chunk)
            view[done:done + n] = chunk
        if n <= 0:
            return None
        done += n
    return buf


def _read_or_create_secret(dir_fd: int, path: str, group: bool) -> bytes:
    """The directory's key for file names: read, or made at first use. Written under an
    O_EXCL name and linked into place (link fails if the name exists), so processes
    starting together all end up with the first one's, whole."""
    file_mode = _modes(group)[1] & ~0o022   # members read it; nobody rewrites it
    for _ in range(4):
        try:
            opened = _open_regular(dir_fd, SECRET_NAME)
        except ValueError as e:
            raise _unusable(path, f"{e}: remove {SECRET_NAME} (every block file becomes unreachable)") from None
        if opened is not None:
            fd, st = opened
            try:
                mode = stat.S_IMODE(st.st_mode)
                if (mode & 0o007) or (not group and (st.st_uid != os.geteuid() or mode & 0o077)):
                    raise _unusable(path, f"{SECRET_NAME} is mode {mode:04o}, uid {st.st_uid}: others could read "
                                          "it; remove it (every block file becomes unreachable)")
                secret = read_exact(fd, SECRET_BYTES, 0) if st.st_size == SECRET_BYTES else None
            finally:
                os.close(fd)
            if secret is None:
                raise _unusable(path, f"{SECRET_NAME} is damaged; remove it (every block file becomes unreachable)")
            return secret.tobytes()
        fd, tmp = _create_temporary(dir_fd, file_mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(SECRET_BYTES))
            os.link(tmp, SECRET_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            pass   # another process linked its own first: read that one
        finally:
            os.unlink(tmp, dir_fd=dir_fd)
    raise _unusable(path, f"{SECRET_NAME} keeps changing")


def _key_name(key: bytes) -> str:
    return key.hex() + _SUFFIX


class DiskBlockStore:
    """Blocks in one directory, at most max_bytes of files among all the processes sharing
    it (oldest modification first out; a hit renews it). Writes go through a background
    thread: put() never blocks. group: share the directory with its group (docs/prefix-tiers.md)."""

    def __init__(self, directory: str, max_bytes: int, group: bool = False,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES):
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        self.group = group
        self.reserve_bytes = int(reserve_bytes)   # left free on the filesystem: below it, no write
        self.num_skipped = 0       # writes skipped because the filesystem was below its reserve
        self._file_mode = _modes(group)[1]
        self.num_corrupt = 0       # files found damaged (removed, counted as misses)
        self.num_dropped = 0       # writes dropped because the backlog was full
        self.num_written = 0
        self.num_evicted = 0       # files this process removed to keep the directory's bound
        self._lock = threading.Lock()   # the counters, shared with the writer
        self._released = 0         # bytes of damaged files removed since the writer last counted
        self._dir = open_directory(self.directory, group)
        self._lock_fd = -1
        try:
            self.secret = _read_or_create_secret(self._dir, self.directory, group)
            self._lock_fd = self._open_lock_file()
            self.num_bytes = self._recount()
        except OSError as e:
            self._close_fds()
            raise _unusable(self.directory, e.strerror or str(e)) from None
        except BaseException:
            self._close_fds()
            raise
        self._queue: queue.Queue = queue.Queue()
        self._pending: set[bytes] = set()   # keys queued, not yet on disk
        self._pending_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="pyllama-paged-kv-disk", daemon=True)
        self._writer.start()

    # ---- the shared byte count ------------------------------------------------
    def _open_lock_file(self) -> int:
        not_regular = _unusable(self.directory, f"{LOCK_NAME} is not a regular file: remove it")
        try:
            if not stat.S_ISREG(os.stat(LOCK_NAME, dir_fd=self._dir, follow_symlinks=False).st_mode):
                raise not_regular
        except FileNotFoundError:
            pass
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC,
                         self._file_mode, dir_fd=self._dir)
        except OSError as e:   # ELOOP: a symlink planted since the lstat
            raise _unusable(self.directory, f"{LOCK_NAME}: {e.strerror}; remove it") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise not_regular
        if st.st_uid == os.geteuid():   # ours: the mode and group every member needs to write the count
            try:
                if stat.S_IMODE(st.st_mode) != self._file_mode:
                    os.fchmod(fd, self._file_mode)
                if self.group and st.st_gid != os.fstat(self._dir).st_gid:
                    os.fchown(fd, -1, os.fstat(self._dir).st_gid)
            except OSError:
                os.close(fd)
                raise
        return fd

    @contextmanager
    def _locked(self):
        """The directory's flock, held by one process's writer at a time (never the engine thread)."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_count(self) -> int | None:
        raw = os.pread(self._lock_fd, _COUNT.size, 0)
        return _COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else None

    def _write_count(self, total: int) -> None:
        os.pwrite(self._lock_fd, _COUNT.pack(total), 0)
        self.num_bytes = total

    def _recount(self) -> int:
        """Count the directory's files afresh (and evict past the bound), under the lock."""
        with self._locked():
            total = self._scan_and_evict()
            self._write_count(total)
        return total

    def _account(self, added: int) -> None:
        """Add a write's bytes to the shared count; past the bound, evict the oldest files."""
        with self._lock:
            released, self._released = self._released, 0
        with self._locked():
            count = self._read_count()
            total = None if count is None else count + added - released
            if total is None or total < 0 or total > self.max_bytes:
                total = self._scan_and_evict()   # also corrects what crashes and other tools left
            self._write_count(total)

    def _scan_and_evict(self) -> int:
        """Bytes of block files, counted afresh, after removing the oldest until under 90%
        of max_bytes if they were over it; leftovers go too: stale temporaries, anything
        under a block's name that is not a regular file."""
        entries, total = [], 0
        now = time.time()
        with os.scandir(self._dir) as it:
            for entry in it:
                name = entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if name.endswith(_TMP_SUFFIX):
                    if now - st.st_mtime > _STALE_TEMPORARY_SECONDS:   # a process died mid-write
                        self._unlink(name)
                elif name.endswith(_SUFFIX):
                    if not stat.S_ISREG(st.st_mode):
                        self._unlink(name)
                    else:
                        entries.append((st.st_mtime, name, st.st_size))
                        total += st.st_size
        if total <= self.max_bytes:
            return total
        entries.sort()
        target = self.max_bytes * 9 // 10
        for _, name, size in entries:
            if total <= target:
                break
            self._unlink(name)
            total -= size   # gone, by us or by another process
            self.num_evicted += 1
        return total

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir)
        except OSError:
            pass

    # ---- reading -------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return self.has(key)

    def has(self, key: bytes, nbytes: int | None = None) -> bool:
        """Whether a regular file of the block is there (of nbytes of payload, if given)."""
        if key in self._pending:
            return True
        if self._dir < 0:
            return False
        name = _key_name(key)
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        if nbytes is not None and st.st_size != _HEADER.size + nbytes:
            # entries appear whole (written aside, then renamed): another length is a damaged
            # file, counted and removed here as a read would, since no read will come for it
            self._corrupt(name, st)
            return False
        return True

    def get(self, key: bytes, nbytes: int | None = None) -> np.ndarray | None:
        """The block's bytes, checked against the file's checksum; None if the file is
        missing, not of nbytes of payload (when given), short or damaged (a damaged file is
        removed). The length is checked before anything is read."""
        if self._dir < 0:
            return None
        name = _key_name(key)
        try:
            opened = _open_regular(self._dir, name)
        except ValueError:
            return self._corrupt(name, None)
        except OSError:
            return None
        if opened is None:
            return None
        fd, st = opened
        try:
            size = st.st_size
            payload_bytes = size - _HEADER.size
            if payload_bytes < 0 or payload_bytes > self.max_bytes or \
                    (nbytes is not None and payload_bytes != nbytes):
                return self._corrupt(name, st)
            header = read_exact(fd, _HEADER.size, 0)
            if header is None:
                return self._corrupt(name, st)
            magic, file_key, n, crc, header_crc = _HEADER.unpack(header.tobytes())
            if magic != _MAGIC or file_key != key or n != payload_bytes or \
                    zlib.crc32(header[:_HEADER.size - 4]) != header_crc:
                return self._corrupt(name, st)
            data = read_exact(fd, n, _HEADER.size)
            if data is None or zlib.crc32(data) != crc:
                return self._corrupt(name, st)
            try:
                os.utime(fd)   # a hit keeps the file young (on the descriptor: never a path)
            except OSError:
                pass
            return data
        except OSError:
            return None
        finally:
            os.close(fd)

    def _corrupt(self, name: str, st: os.stat_result | None) -> None:
        """Count and remove a damaged entry, if it is still the one that was read (another
        process may have renamed a good file into its place since)."""
        with self._lock:
            self.num_corrupt += 1
        try:
            now = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
            if st is None or (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(name, dir_fd=self._dir)
                if stat.S_ISREG(now.st_mode):
                    with self._lock:
                        self._released += now.st_size
        except OSError:
            pass
        return None

    # ---- writing ------------------------------------------------------------
    def put(self, key: bytes, data: np.ndarray) -> None:
        """Queue a block for writing (dropped if the writer is that far behind, or if the
        directory already holds it)."""
        if key in self._pending or data.nbytes + _HEADER.size > self.max_bytes or self._dir < 0:
            return
        with self._lock:
            if self._pending_bytes + data.nbytes > _WRITE_BACKLOG_BYTES:
                self.num_dropped += 1
                return
            self._pending_bytes += data.nbytes
        self._pending.add(key)
        self._queue.put((key, data))

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer and let go of the directory."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._close_fds()

    def _room_for(self, nbytes: int) -> bool:
        """Whether the filesystem keeps its reserve free after nbytes more (else counted as skipped)."""
        fs = os.fstatvfs(self._dir)
        if fs.f_bavail * fs.f_frsize - nbytes >= self.reserve_bytes:
            return True
        with self._lock:
            self.num_skipped += 1
        return False

    def _close_fds(self) -> None:
        for attr in ("_lock_fd", "_dir"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                setattr(self, attr, -1)
                os.close(fd)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, data = item
                try:
                    self._write(key, data)
                except OSError:
                    pass   # a full or read-only disk: the block is simply not kept
                finally:
                    self._pending.discard(key)
                    with self._lock:
                        self._pending_bytes -= data.nbytes
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, data: np.ndarray) -> None:
        name = _key_name(key)
        try:
            if stat.S_ISREG(os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_mode):
                return   # written already, by this process or another
        except FileNotFoundError:
            pass
        if not self._room_for(_HEADER.size + data.nbytes):
            return
        # anything else under the name (a planted symlink) is replaced by the rename below,
        # never opened
        payload = np.ascontiguousarray(data, dtype=np.uint8)
        header = _HEADER.pack(_MAGIC, key, payload.nbytes, zlib.crc32(payload), 0)
        header = header[:-4] + struct.pack("<I", zlib.crc32(header[:-4]))
        fd, tmp = _create_temporary(self._dir, self._file_mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload.data)
            os.rename(tmp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)   # atomic: whole file or none
        except BaseException:
            self._unlink(tmp)
            raise
        with self._lock:
            self.num_written += 1
        self._account(len(header) + payload.nbytes)
