"""A vision projector ("mmproj") GGUF: its clip.* metadata read, its tower and projector
described to the native encoder (pp_vision_*), images encoded to embedding rows."""

from __future__ import annotations

import functools
import threading

import numpy as np

from .._native import NativeHandle, check, ffi, lib
from .._native.tensors import attach_tensors
from ..errors import ModelLoadError, NativeError
from ..gguf.reader import GGUFFile

PROJECTORS = {"gemma3": lib.PP_PROJECTOR_GEMMA3}
# Gemma 3's files written before clip.vision.projector.scale_factor existed pool 4 x 4 patches.
DEFAULT_SCALE_FACTOR = {"gemma3": 4}


def _meta(meta: dict, key: str, path: str, kind=int):
    value = meta.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: metadata field '{key}' is missing")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{path}: metadata field '{key}' is {value!r}, not a {kind.__name__}") from None


def _triple(meta: dict, key: str, path: str) -> tuple[float, float, float]:
    value = meta.get(key)
    try:   # the reader gives numeric arrays as numpy arrays
        triple = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        triple = None
    if triple is None or triple.ndim != 1 or len(triple) < 3 or not np.isfinite(triple[:3]).all():
        raise ModelLoadError(f"{path}: metadata field '{key}' must be an array of 3 numbers")
    return float(triple[0]), float(triple[1]), float(triple[2])


class Projector(NativeHandle):
    """One projector file's vision encoder. ``encode(pixels)`` is thread-safe (one image at a
    time); the file stays mapped while it lives."""

    _destroy = staticmethod(lib.pp_vision_destroy)

    def __init__(self, path: str, n_threads: int = 1):
        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        meta = self.gguf.metadata
        if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
            raise ModelLoadError(f"{self.path}: not a vision projector (clip) file")
        kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
        if kind not in PROJECTORS:
            raise ModelLoadError(f"{self.path}: projector type {kind!r} is not supported "
                                 f"(supported: {', '.join(PROJECTORS)})")
        self.projector_type = kind
        self.image_size = _meta(meta, "clip.vision.image_size", self.path)
        self.image_mean = _triple(meta, "clip.vision.image_mean", self.path)
        self.image_std = _triple(meta, "clip.vision.image_std", self.path)
        self.projection_dim = _meta(meta, "clip.vision.projection_dim", self.path)
        self._lock = threading.Lock()
        self._create(meta, n_threads)

    def _create(self, meta: dict, n_threads: int) -> None:
        p = self.path
        hp = ffi.new("pp_vision_hparams *", {
            "projector": PROJECTORS[self.projector_type], "image_size": self.image_size,
            "patch_size": _meta(meta, "clip.vision.patch_size", p),
            "n_embd": _meta(meta, "clip.vision.embedding_length", p),
            "n_head": _meta(meta, "clip.vision.attention.head_count", p),
            "n_ff": _meta(meta, "clip.vision.feed_forward_length", p),
            "n_layer": _meta(meta, "clip.vision.block_count", p),
            "scale_factor": int(meta.get("clip.vision.projector.scale_factor",
                                         DEFAULT_SCALE_FACTOR[self.projector_type])),
            "projection_dim": self.projection_dim,
            "eps": _meta(meta, "clip.vision.attention.layer_norm_epsilon", p, float),
        })
        out = ffi.new("pp_vision **")
        self._check(lib.pp_vision_create(hp, n_threads, out), "vision encoder")
        self._handle = out[0]
        attach_tensors(self.gguf, functools.partial(lib.pp_vision_set_tensor, self._handle), self._check)
        self._check(lib.pp_vision_finalize(self._handle), "weights")
        self.n_tokens = int(lib.pp_vision_n_tokens(self._handle))

    def _check(self, status: int, what: str) -> None:
        try:
            check(status, what)
        except NativeError as e:
            self.close()
            raise ModelLoadError(f"{self.path}: {e}") from None

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """Embedding rows [n_tokens, projection_dim] (float32) of normalised pixels [3, size, size]."""
        size = self.image_size
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        if pixels.shape != (3, size, size):
            raise ValueError(f"pixels must be [3, {size}, {size}], got {list(pixels.shape)}")
        out = np.empty((self.n_tokens, self.projection_dim), dtype=np.float32)
        with self._lock:
            if self._handle is None:
                raise ValueError(f"{self.path}: the projector is closed")
            check(lib.pp_vision_encode(self._handle, ffi.from_buffer("float[]", pixels),
                                       ffi.from_buffer("float[]", out)), "image encoding")
        return out

    def close(self) -> None:
        """Free the encoder and unmap the file."""
        super().close()
        if getattr(self, "gguf", None) is not None:
            self.gguf.close()
            self.gguf = None
