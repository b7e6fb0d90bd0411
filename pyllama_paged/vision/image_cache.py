"""Encoded images kept by content hash (a bounded LRU), so a chat's later turns about the same
picture, or many users sending the same one, run the vision tower once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .preprocess import DEFAULT_MAX_PIXELS, image_hash, preprocess

# How an image position's (negative) token id is made: 12 bits of row number, 19 of the hash.
ROW_BITS, HASH_BITS_PER_ROW = 12, 19

# Bytes of embedding rows kept by default (a Gemma 3 image is 256 x 2560 floats, 2.6 MB).
DEFAULT_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class EncodedImage:
    """One image's embedding rows [n_tokens, n_embd] and the content hash it is known by."""

    hash: str
    embeddings: np.ndarray

    @property
    def n_tokens(self) -> int:
        """Embedding rows: the positions the image takes in the prompt."""
        return int(self.embeddings.shape[0])

    def token_ids(self) -> list[int]:
        """The ids the image's positions hold in a sequence: negative (no vocabulary row), each
        its row number (12 bits) and 19 bits of the content hash, a different slice of it per
        row, so the prefix cache's block hashes (and its token comparison) tell two images apart
        wherever they cover 14 or more rows, and the runner knows these rows take embeddings."""
        bits = int(self.hash, 16)
        n_slices = (len(self.hash) * 4) // HASH_BITS_PER_ROW
        ids = []
        for row in range(self.n_tokens):
            piece = (bits >> (HASH_BITS_PER_ROW * (row % n_slices))) & ((1 << HASH_BITS_PER_ROW) - 1)
            ids.append(-1 - ((piece << ROW_BITS) | (row & ((1 << ROW_BITS) - 1))))
        return ids


class ImageCache:
    """An LRU of EncodedImage by hash, bounded in bytes; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, EncodedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> EncodedImage | None:
        """The entry for key (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, entry: EncodedImage) -> None:
        """Keep entry, evicting the least recently used past the byte bound (an entry larger
        than the whole bound is not kept)."""
        size = entry.embeddings.nbytes
        with self._lock:
            if entry.hash in self._entries or size > self.max_bytes:
                return
            self._entries[entry.hash] = entry
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.embeddings.nbytes

    def __len__(self) -> int:
        return len(self._entries)


class ImageEncoder:
    """A projector with its cache: image bytes to an EncodedImage, encoding each content once."""

    def __init__(self, projector, cache: ImageCache | None = None, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.projector = projector
        self.cache = cache if cache is not None else ImageCache()
        self.max_pixels = max_pixels
        self.n_encoded = 0

    def encode(self, data: bytes) -> EncodedImage:
        """The image's embeddings, from the cache or the tower (ImageError for bad data)."""
        key = image_hash(data)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        p = self.projector
        pixels = preprocess(data, p.image_size, p.image_mean, p.image_std, self.max_pixels)
        entry = EncodedImage(key, p.encode(pixels))
        entry.embeddings.setflags(write=False)
        self.n_encoded += 1
        self.cache.put(entry)
        return entry
