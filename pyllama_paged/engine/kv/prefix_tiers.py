"""The prefix cache's tiers below the pool: host RAM and, optionally, a disk
directory. The pool's prefix cache forgets a block when it is evicted and
everything at a restart; the tiers keep full computed blocks by content, so a
prompt whose prefix was computed before, by this process or an earlier one, has
its KV copied back into the pool instead of recomputed.

A block's key is a chain: the key of the block before it (the first block's
parent is the model's KV identity: its weights' fingerprint, the KV type, block
size and layer groups, keyed by the disk directory's secret when there is one) and
the block's token ids, hashed with BLAKE2b. The pool's own hashes cannot serve:
they are keyed at random per process, and a disk tier is shared by processes and
restarts. Keyed by the directory's secret, a file name tells nothing of the prompt
to whoever cannot read that secret (file names are public inputs otherwise: the
model and the tokens). A tier entry holds the block's K and V in every layer group,
as the model runner reads them.

Blocks go down as they are computed (write-through: the engine's KVMover, before
the pool's commit can give a sliding-window group's blocks back), so an eviction
from the pool needs no hook in the native pool. They come back at admission: the
scheduler looks keys up and pins each block it restores (ids and counts), the
engine writes the pinned bytes into the pages it was given. A disk entry is read
and checked when pinned, not later: its checksum is known only once it is read,
and the pool cannot take back a block it was told is computed (a window group may
already have given it back, another prompt may already share it), so a damaged or
vanished file must be found before the scheduler counts the block."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import PagedError
from ...flags import flagged, mebibytes, show_size, size_bytes
from .block_store import DEFAULT_RESERVE_BYTES, KEY_BYTES, DiskBlockStore, HostBlockStore, check_directory

# bytes of each tensor's data that go into a model's fingerprint: weights that differ
# anywhere differ in every tensor's first rows (a fine-tune, another quantization)
_FINGERPRINT_TENSOR_BYTES = 4096


@dataclass(slots=True)
class PrefixTierConfig:
    """The tiers of one engine. ram_bytes: the host-RAM tier's bound (0: none); disk_dir:
    the disk tier's directory (None: none), holding at most disk_bytes of block files
    among all the processes sharing it; disk_group: share it with the accounts of its
    group instead of keeping it private to this one (docs/prefix-tiers.md);
    disk_reserve_bytes: left free on the directory's filesystem (no block is written below it)."""

    ram_bytes: int = flagged(0, "--cache-ram", "host RAM that keeps computed prompt blocks after the KV pool "
                             "evicts them, per model, restored instead of recomputed (llama-server's flag; 0: off)",
                             type=mebibytes, show=lambda v: v >> 20, metavar="MiB")
    disk_dir: str | None = flagged(None, "--prefix-cache-dir", "also keep computed prompt blocks in this directory, "
                                   "across restarts and for other servers sharing it (content-addressed, "
                                   "checksummed; off by default)", metavar="DIR")
    disk_bytes: int = flagged(16 << 30, "--prefix-cache-disk", "most bytes of block files --prefix-cache-dir holds "
                              "(oldest go first)", type=size_bytes, show=show_size, metavar="SIZE")
    disk_group: bool = flagged(False, "--prefix-cache-group", "share --prefix-cache-dir with the accounts of its "
                               "group (a 2770 directory of a group of exactly those accounts; docs/prefix-tiers.md) "
                               "instead of keeping it private", action="store_true")
    disk_reserve_bytes: int = DEFAULT_RESERVE_BYTES

    def __post_init__(self):
        if self.ram_bytes < 0:
            raise PagedError(f"the prefix cache's RAM tier must be >= 0 bytes, got {self.ram_bytes}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise PagedError(f"the prefix cache's disk tier must hold > 0 bytes, got {self.disk_bytes}")

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0 or self.disk_dir is not None

    @classmethod
    def from_options(cls, values: dict) -> "PrefixTierConfig | None":
        """The tiers of the command line's options (None: none enabled); a disk tier's
        directory is made and checked now, at startup, not at the first model load."""
        config = cls(**values)
        config.check_disk()
        return config if config.enabled else None

    def check_disk(self) -> None:
        """Create the disk tier's directory if needed and check it is safe and writable (at
        startup, not at the first model load); PagedError saying why not."""
        if self.disk_dir is not None:
            check_directory(self.disk_dir, self.disk_group)


def model_fingerprint(gguf) -> bytes:
    """A digest of a GGUF's metadata, tensor table and the first bytes of every tensor:
    changes with any other weights, costs milliseconds even for GBs of them."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for i, part in enumerate(gguf.parts):   # a split GGUF's files in order (one for a plain file)
        data = part.data
        first = min((t.offset for t in gguf.tensors if t.part == i), default=len(data))
        h.update(len(data).to_bytes(8, "little"))
        h.update(memoryview(data[:first]))
    for t in gguf.tensors:
        h.update(memoryview(gguf.tensor_bytes(t)[:_FINGERPRINT_TENSOR_BYTES]))
    return h.digest()


def kv_identity(fingerprint: bytes, kv_cache_type: str, block_size: int, layer_group: Sequence[int],
                group_window: Sequence[int], block_bytes: int) -> bytes:
    """The parent key of every chain: which bytes a block of this model and KV layout holds."""
    desc = repr(("pyllama-paged kv 1", kv_cache_type, block_size, tuple(layer_group), tuple(group_window),
                 block_bytes)).encode()
    return hashlib.blake2b(fingerprint + desc, digest_size=KEY_BYTES).digest()


def chain_keys(identity: bytes, token_ids: Sequence[int], block_size: int, end: int,
               known: list[bytes] | None = None) -> list[bytes]:
    """Keys of blocks [0, end) of token_ids, extending `known` (the keys of its first
    blocks, reused as they are); returns the extended list."""
    keys = list(known) if known else []
    if len(keys) >= end:
        return keys[:end]
    ids = np.asarray(token_ids[len(keys) * block_size:end * block_size], dtype=np.int32)
    parent = keys[-1] if keys else identity
    for i in range(end - len(keys)):
        parent = hashlib.blake2b(parent + ids[i * block_size:(i + 1) * block_size].tobytes(),
                                 digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


class PrefixTiers:
    """The host-RAM and disk stores under one engine's pool, and their counters."""

    def __init__(self, config: PrefixTierConfig, identity: bytes, block_size: int, n_groups: int,
                 block_bytes: int):
        self.config = config
        self.identity = identity
        self.block_size = block_size
        self.n_groups = n_groups
        self.block_bytes = block_bytes       # one group's block; an entry holds n_groups of them
        self.ram = HostBlockStore(config.ram_bytes) if config.ram_bytes > 0 else None
        self.disk = DiskBlockStore(config.disk_dir, config.disk_bytes, config.disk_group,
                                   config.disk_reserve_bytes) if config.disk_dir else None
        if self.disk is not None:
            # every chain starts here: keyed, no file name can be computed from a prompt without
            # the directory's secret
            self.identity = hashlib.blake2b(identity, key=self.disk.secret, digest_size=KEY_BYTES).digest()
        self.num_saved = 0                   # blocks written down
        self.num_ram_hits = 0                # blocks restored from RAM
        self.num_disk_hits = 0               # ... from disk
        self.num_misses = 0                  # runs of lookups ended by a block no tier holds
        self._pinned: dict[bytes, np.ndarray] = {}   # blocks being restored this step

    @property
    def entry_bytes(self) -> int:
        return self.block_bytes * self.n_groups

    def keys(self, token_ids: Sequence[int], end: int, known: list[bytes] | None = None) -> list[bytes]:
        """Chain keys of blocks [0, end) of token_ids (reusing `known` first keys)."""
        return chain_keys(self.identity, token_ids, self.block_size, end, known)

    def has(self, key: bytes) -> bool:
        """Whether a tier holds the block (a RAM hit counts as a use)."""
        if self.ram is not None and self.ram.touch(key):
            return True
        return self.disk is not None and self.disk.has(key, self.entry_bytes)

    def run_length(self, keys: Sequence[bytes]) -> int:
        """How many of keys, from the first, some tier holds (a miss ends the run, counted)."""
        for n, key in enumerate(keys):
            if not self.has(key):
                self.num_misses += 1
                return n
        return len(keys)

    def load(self, key: bytes) -> np.ndarray | None:
        """The block's bytes from RAM, else disk (then kept in RAM too), else None."""
        data = self.ram.get(key) if self.ram is not None else None
        if data is not None:
            self.num_ram_hits += 1
            return data
        # on the engine thread: with the length checked before any read, a hit costs one
        # entry's pread and checksum, as much as copying it into the pool
        data = self.disk.get(key, self.entry_bytes) if self.disk is not None else None
        if data is not None:
            self.num_disk_hits += 1
            if self.ram is not None:
                self.ram.put(key, data)
            return data
        self.num_misses += 1   # held a moment ago (run_length), gone or damaged now
        return None

    def pin(self, key: bytes) -> bool:
        """Hold the block's bytes until unpin_all (the engine writes them into the pool
        meanwhile); False if no tier can give them (a miss)."""
        data = self.load(key)
        if data is None:
            return False
        # held here, not only in the RAM tier: a later pin's disk hit may evict it from there
        self._pinned[key] = data
        return True

    def pinned(self, key: bytes, group: int) -> np.ndarray:
        """Layer group `group`'s part of a pinned block: one pool block's bytes."""
        return self._pinned[key][group * self.block_bytes:(group + 1) * self.block_bytes]

    def unpin_all(self) -> None:
        """Let go of every pinned block (written into the pool, or never to be)."""
        self._pinned.clear()

    def save(self, key: bytes, data: np.ndarray) -> None:
        """Keep a computed block in every tier (the tiers own data from here)."""
        self.num_saved += 1
        if self.ram is not None:
            self.ram.put(key, data)
        if self.disk is not None:
            self.disk.put(key, data)

    def flush(self) -> None:
        """Wait for queued disk writes."""
        if self.disk is not None:
            self.disk.flush()

    def clear_ram(self) -> int:
        """Drop the RAM tier's blocks (the disk tier is shared: kept); returns how many."""
        if self.ram is None:
            return 0
        n = len(self.ram)
        self.ram.clear()
        return n

    def close(self) -> None:
        """Write what is queued to disk; drop the RAM tier."""
        if self.disk is not None:
            self.disk.close()
        if self.ram is not None:
            self.ram.clear()

    def stats(self) -> dict:
        """Counters for the engine's stats and /metrics."""
        out = {"tier_saved_blocks": self.num_saved, "tier_ram_hit_blocks": self.num_ram_hits,
               "tier_disk_hit_blocks": self.num_disk_hits, "tier_miss_blocks": self.num_misses}
        if self.ram is not None:
            out.update(tier_ram_blocks=len(self.ram), tier_ram_bytes=self.ram.num_bytes,
                       tier_ram_max_bytes=self.ram.max_bytes)
        if self.disk is not None:
            out.update(tier_disk_bytes=self.disk.num_bytes, tier_disk_max_bytes=self.disk.max_bytes,
                       tier_disk_corrupt_files=self.disk.num_corrupt, tier_disk_dropped_writes=self.disk.num_dropped,
                       tier_disk_skipped_writes=self.disk.num_skipped)
        return out


def default_disk_dir() -> str:
    """Where `--prefix-cache-dir` with no value keeps blocks: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyllama-paged", "kv-blocks")
