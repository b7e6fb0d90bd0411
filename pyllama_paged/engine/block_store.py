"""Stores for KV blocks below the pool: bytes by content key, nothing else. A key
names one block's K and V in every layer (the prefix tier derives it from the
model, the KV layout and the chain of tokens up to that block); a store keeps
the bytes and gives them back, or says it has none. Two stores:

- HostBlockStore: process memory, bounded bytes, least recently used first out.
- DiskBlockStore: one directory, one file per block, named by its key. Files are
  written under a temporary name and renamed into place (a reader sees a whole
  file or none), carry a checksum, and are read back through mmap. Several
  processes may share the directory: a file another process removes, truncates
  or corrupts is a miss (and is deleted), never an exception or wrong bytes.

Neither knows of models, pools or the engine."""

from __future__ import annotations

import mmap
import os
import queue
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict

import numpy as np

from ..errors import PagedError

KEY_BYTES = 16
# magic, key, payload bytes, crc32 of the payload, crc32 of the header before it
_HEADER = struct.Struct(f"<8s{KEY_BYTES}sQII")
_MAGIC = b"PPKVBLK1"
_SUFFIX = ".kvb"
_STALE_TEMPORARY_SECONDS = 3600
# the disk writer's backlog: beyond this many bytes waiting, new blocks are dropped (the
# engine never waits on the disk; a dropped block is recomputed if it is ever missed)
_WRITE_BACKLOG_BYTES = 256 << 20


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
        self._blocks.clear()
        self.num_bytes = 0


def check_directory(directory: str) -> None:
    """Create directory if needed and check that files can be written there; PagedError
    saying why not."""
    try:
        os.makedirs(directory, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp").close()
    except OSError as e:
        raise PagedError(f"the prefix cache directory {directory} cannot be used: {e.strerror or e}") from None


def _key_name(key: bytes) -> str:
    return key.hex() + _SUFFIX


class DiskBlockStore:
    """Blocks in one directory, at most max_bytes of files (oldest modification first out;
    a hit renews it). Writes go through a background thread: put() never blocks."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        check_directory(self.directory)
        self._remove_stale_temporaries()
        self.num_bytes = self._scan_bytes()
        self.num_corrupt = 0       # files found damaged (removed, counted as misses)
        self.num_dropped = 0       # writes dropped because the backlog was full
        self.num_written = 0
        self._lock = threading.Lock()   # num_bytes and the counters, shared with the writer
        self._queue: queue.Queue = queue.Queue()
        self._pending: set[bytes] = set()   # keys queued, not yet on disk
        self._pending_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="pyllama-paged-kv-disk", daemon=True)
        self._writer.start()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, _key_name(key))

    def _remove_stale_temporaries(self) -> None:
        """Temporary files a process left when it died mid-write (an hour old: not a live write)."""
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".tmp"):
                    try:
                        if now - entry.stat().st_mtime > _STALE_TEMPORARY_SECONDS:
                            os.unlink(entry.path)
                    except OSError:
                        pass

    def _scan_bytes(self) -> int:
        total = 0
        for entry in self._entries():
            total += entry[2]
        return total

    def _entries(self) -> list[tuple[float, str, int]]:
        """(mtime, path, size) of every block file now in the directory."""
        out = []
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if entry.name.endswith(_SUFFIX):
                        try:
                            st = entry.stat()
                        except FileNotFoundError:
                            continue   # another process removed it
                        out.append((st.st_mtime, entry.path, st.st_size))
        except FileNotFoundError:
            pass
        return out

    # ---- reading -------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._pending or os.path.exists(self._path(key))

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes, checked against the file's checksum; None if the file is
        missing, short or damaged (a damaged file is removed)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                return self._corrupt(path)
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
                magic, file_key, n, crc, header_crc = _HEADER.unpack_from(mm, 0)
                if magic != _MAGIC or file_key != key or \
                        zlib.crc32(mm[:_HEADER.size - 4]) != header_crc or size != _HEADER.size + n:
                    return self._corrupt(path)
                payload = memoryview(mm)[_HEADER.size:]
                try:
                    if zlib.crc32(payload) != crc:
                        return self._corrupt(path)
                    data = np.frombuffer(payload, dtype=np.uint8).copy()
                finally:
                    payload.release()
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        try:
            os.utime(path)   # a hit keeps the file young
        except OSError:
            pass
        return data

    def _corrupt(self, path: str) -> None:
        with self._lock:
            self.num_corrupt += 1
        try:
            os.unlink(path)
        except OSError:
            pass
        return None

    # ---- writing ------------------------------------------------------------
    def put(self, key: bytes, data: np.ndarray) -> None:
        """Queue a block for writing (dropped if the writer is that far behind, or if the
        directory already holds it)."""
        if key in self._pending or data.nbytes + _HEADER.size > self.max_bytes:
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
        """Write what is queued, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

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
        path = self._path(key)
        if os.path.exists(path):
            return
        payload = np.ascontiguousarray(data, dtype=np.uint8)
        header = _HEADER.pack(_MAGIC, key, payload.nbytes, zlib.crc32(payload), 0)
        header = header[:-4] + struct.pack("<I", zlib.crc32(header[:-4]))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload.data)
        os.replace(tmp, path)   # atomic: readers see the whole file or none
        with self._lock:
            self.num_written += 1
            self.num_bytes += len(header) + payload.nbytes
            over = self.num_bytes > self.max_bytes
        if over:
            self._shrink()

    def _shrink(self) -> None:
        """Remove the oldest files until the directory is under 90% of max_bytes. The
        directory is rescanned: other processes write and remove files too."""
        entries = sorted(self._entries())
        total = sum(size for _, _, size in entries)
        target = self.max_bytes * 9 // 10
        for _, path, size in entries:
            if total <= target:
                break
            try:
                os.unlink(path)
                total -= size
            except FileNotFoundError:
                total -= size   # another process took it first
            except OSError:
                pass
        with self._lock:
            self.num_bytes = total
