"""LoRA adapters: a GGUF adapter file (llama.cpp's convert_lora_to_gguf.py writes them:
general.type = adapter, adapter.type = lora, adapter.lora.alpha, tensors "<base tensor>.lora_a"
and ".lora_b") read and checked against a loaded model, its weights copied into the native
adapter (pp_lora_*), which a step applies to the tokens of the sequences that run it."""

from __future__ import annotations

import argparse
import hashlib
import math
import numbers

from ..._native import NativeHandle, ffi, lib
from ...gguf.config import ModelLoadError
from ...gguf.reader import GGUFFile
from ..kv.prefix_tiers import model_fingerprint
from .model import Model, load_checked

# adapter.alora.invocation_tokens marks an activated LoRA (its tokens switch it on mid-prompt)
_ALORA_KEY = "adapter.alora.invocation_tokens"


class LoraAdapter(NativeHandle):
    """One LoRA adapter file attached to a loaded model (the model must outlive it). Its
    fingerprint names its weights: a sequence's prefix-cache chain starts from it (kv_root)."""

    _destroy = staticmethod(lib.pp_lora_destroy)

    def __init__(self, model: Model, path: str):
        self.path = str(path)
        self.model = model
        gguf = GGUFFile(self.path)
        try:
            self.alpha = _check_metadata(gguf.metadata, self.path, model.config.arch)
            self.fingerprint = model_fingerprint(gguf)
            self._attach(model, gguf)
        finally:
            gguf.close()
        self.n_pairs = int(lib.pp_lora_n_pairs(self._handle))
        self.n_bytes = int(lib.pp_lora_bytes(self._handle))

    def _attach(self, model: Model, gguf: GGUFFile) -> None:
        """The native adapter: every tensor given, then checked as a whole and copied."""
        out = ffi.new("pp_lora **")
        self._wrap(lib.pp_lora_create(model.native, self.alpha, out))
        self._handle = out[0]
        ne = ffi.new("int64_t[4]")
        for t in gguf.tensors:
            for i, dim in enumerate(t.shape):
                ne[i] = dim
            data = ffi.from_buffer(gguf.tensor_bytes(t))
            self._wrap(lib.pp_lora_set_tensor(self._handle, t.name.encode(), t.type, ne, len(t.shape), data,
                                              t.n_bytes))
        self._wrap(lib.pp_lora_finalize(self._handle))

    def _wrap(self, status: int) -> None:
        load_checked(status, "LoRA adapter", self.path, self.close)

    @property
    def native(self):
        """The pp_lora handle (valid until close)."""
        if self._handle is None:
            raise ModelLoadError(f"{self.path}: the LoRA adapter is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        """Whether close() has freed the native adapter."""
        return self._handle is None

    def kv_root(self, scale: float) -> int:
        """The root of the prefix-cache chain of a sequence this adapter computes at scale: KV
        computed under one (adapter, scale) is never reused under another, nor without it.
        The same in every process (a disk tier's keys are derived from it); never 0."""
        digest = hashlib.blake2b(self.fingerprint + repr(float(scale)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") or 1


def _check_metadata(metadata: dict, path: str, arch: str) -> float:
    """The adapter's alpha, once its metadata says it is a LoRA adapter of this architecture."""
    kind = metadata.get("general.type")
    if kind != "adapter":
        raise ModelLoadError(f"{path}: not an adapter file (general.type is {kind!r}, an adapter's is 'adapter')")
    adapter = metadata.get("adapter.type")
    if adapter != "lora":
        raise ModelLoadError(f"{path}: adapter.type is {adapter!r}; only 'lora' adapters are supported")
    if _ALORA_KEY in metadata:
        raise ModelLoadError(f"{path}: an activated LoRA ({_ALORA_KEY}); only plain LoRA adapters are supported")
    made_for = metadata.get("general.architecture")
    if made_for != arch:
        raise ModelLoadError(f"{path}: a LoRA adapter for architecture {made_for!r}, but the model is {arch!r} "
                             "(a wrong base model?)")
    alpha = metadata.get("adapter.lora.alpha", 0.0)   # absent: the scale alone, as llama.cpp reads it
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
        raise ModelLoadError(f"{path}: adapter.lora.alpha must be a finite number, got {alpha!r}")
    return float(alpha)


def split_scale(text: str) -> tuple[str, float]:
    """--lora's 'FILE[:SCALE]' as (FILE, SCALE): the part after the last ':' is the scale when it is
    a number (default 1); ArgumentTypeError for an empty file or a scale that is not finite."""
    path, sep, tail = text.rpartition(":")
    scale = 1.0
    if sep:
        try:
            scale = float(tail)
        except ValueError:
            path = text   # a ':' of the path itself
        else:
            if not math.isfinite(scale):
                raise argparse.ArgumentTypeError(f"'{text}': the scale must be a finite number")
    else:
        path = text
    if not path:
        raise argparse.ArgumentTypeError(f"'{text}': no adapter file")
    return path, scale



class StepLoras:
    """A step's adapters in its pp_batch: which one each sequence (item) runs and at what scale,
    from the KV manager's handle -> (adapter, scale) map; cffi arrays kept between steps."""

    def __init__(self):
        self._seq_lora = ffi.new("int32_t[]", 0)
        self._seq_scale = ffi.new("float[]", 0)
        self._loras = ffi.new("pp_lora *[]", 0)
        self.reserved = 0   # the most adapters one step of the context may run

    def fill(self, batch, handles, of: dict, reserve) -> None:
        """Set batch's LoRA fields for the items' handles (none: n_loras 0); reserve(n) makes
        room in the context for steps of n adapters when more than ever before run at once."""
        if not of or not any(h in of for h in handles):
            batch.n_loras = 0
            return
        n = len(handles)
        if len(self._seq_lora) < n:
            self._seq_lora = ffi.new("int32_t[]", 2 * n)
            self._seq_scale = ffi.new("float[]", 2 * n)
        index: dict[int, int] = {}   # id(adapter) -> its index in the step
        adapters = []
        for s, handle in enumerate(handles):
            entry = of.get(handle)
            if entry is None:
                self._seq_lora[s] = -1
                self._seq_scale[s] = 0.0
                continue
            adapter, scale = entry
            k = index.get(id(adapter))
            if k is None:
                k = index[id(adapter)] = len(adapters)
                adapters.append(adapter)
            self._seq_lora[s] = k
            self._seq_scale[s] = scale
        if len(adapters) > self.reserved:
            reserve(len(adapters))
            self.reserved = len(adapters)
        if len(self._loras) < len(adapters):
            self._loras = ffi.new("pp_lora *[]", max(len(adapters), 2 * len(self._loras)))
        for k, adapter in enumerate(adapters):
            self._loras[k] = adapter.native
        batch.n_loras = len(adapters)
        batch.loras = self._loras
        batch.seq_lora = self._seq_lora
        batch.seq_lora_scale = self._seq_scale
