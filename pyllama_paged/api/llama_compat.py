"""llama-cpp-python's constructor arguments mapped onto ours, the small
public classes its users import beside Llama (state, logits processors,
stopping criteria, tokenizer), and the errors for the parts of its API we do
not provide (the low-level ctypes binding). Nothing here runs the model."""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import numpy as np

from ..errors import PagedError, RequestError
from ..tokenizer.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA2_TEMPLATE, LLAMA3_TEMPLATE

# llama.cpp's "no seed given": each generation draws a random one
LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# GGML type ids (ggml.h) of the KV cache types the paged pool stores
_KV_TYPES = {1: "f16", 8: "q8_0", 2: "q4_0"}
_GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL", 30: "BF16"}

# llama-cpp-python's chat_format names whose prompt format we have built in
CHAT_FORMATS = {"gemma": GEMMA_TEMPLATE, "chatml": CHATML_TEMPLATE, "qwen": CHATML_TEMPLATE,
                "llama-3": LLAMA3_TEMPLATE, "llama-2": LLAMA2_TEMPLATE}


def _unused(why: str, **neutral: Any) -> dict[str, tuple[Any, str]]:
    """UNUSED_ARGS rows of arguments that share a reason."""
    return {name: (value, why) for name, value in neutral.items()}


# Constructor arguments that are accepted but change nothing here: name -> (the
# value that asks for nothing, why another value is not honoured). A value other
# than the neutral one warns once.
UNUSED_ARGS: dict[str, tuple[Any, str]] = {
    **_unused("a model runs on one GPU (main_gpu) and the CPU", split_mode=1, tensor_split=None),
    "vocab_only": (False, "the whole model is loaded"),
    "use_mmap": (True, "the weights are always memory-mapped"),
    "use_mlock": (False, "memory is not locked"),
    "kv_overrides": (None, "the GGUF's metadata is used as written"),
    "rope_scaling_type": (-1, "the GGUF's RoPE scaling is used"),
    "rope_freq_base": (0.0, "the GGUF's RoPE frequency base is used"),
    "rope_freq_scale": (0.0, "the GGUF's RoPE frequency scale is used"),
    **_unused("YaRN settings come from the GGUF", yarn_ext_factor=-1.0, yarn_attn_factor=1.0,
              yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=0),
    "attention_type": (-1, "attention is causal for the models we run"),
    "n_ubatch": (512, "a step is sized by n_batch alone"),
    "numa": (False, "no NUMA placement is done"),
    "tokenizer": (None, "the GGUF's own tokenizer is used"),
    "spm_infill": (False, "fill-in-the-middle is not supported"),
    "swa_full": (None, "the KV cache is paged"),
    "lora_base": (None, "the adapter (lora_path) applies to the loaded model's own weights"),
}
# Accepted silently: their effect is already what this engine does (a fused
# attention kernel, KV on the compute device, no perf counters to turn off).
NEUTRAL_ARGS = frozenset({"flash_attn", "offload_kqv", "op_offload", "no_perf"})
# Sampling arguments of create_completion & co that we do not implement, and the
# value that asks for nothing; another value warns once per Llama.
UNUSED_SAMPLING = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0, "penalize_nl": True}


class UnsupportedFeatureError(PagedError, ImportError):
    """A part of llama-cpp-python this package does not provide (an ImportError, so that
    code probing for optional parts with `except ImportError` keeps working); the message
    says what to use instead."""


class UnsupportedAttributeError(PagedError, AttributeError):
    """A low-level llama.cpp name asked of the package (hasattr() still answers False)."""


# the package's llama-cpp-python submodules, importable on first attribute access as theirs are
COMPAT_SUBMODULES = ("llama_speculative", "llama_chat_format", "llama_grammar")


def low_level_message(name: str) -> str:
    """What to say for llama-cpp-python's low-level ctypes API (name: the symbol or module asked for)."""
    return (f"{name}: llama-cpp-python's low-level ctypes API (llama_cpp.llama_cpp: llama_backend_init, "
            "llama_decode, llama_token_get_text, ...) is not provided; pyllama-paged runs its own engine, not "
            "libllama. Use Llama's methods instead: tokenize/detokenize, eval/sample/generate for a token loop, "
            "create_completion, embed, and Llama.runner for the model's forward pass.")


def root_attribute(package: str, name: str):
    """The package's module __getattr__: a compat submodule imported on first use; a
    low-level llama.cpp name refused with what to use instead; anything else missing."""
    if name in COMPAT_SUBMODULES:
        import importlib

        return importlib.import_module(f"{package}.{name}")
    if name.lower().startswith(("llama_", "ggml_", "llava_", "mtmd_")):
        raise UnsupportedAttributeError(low_level_message(name))
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class CompatWarnings:
    """Warn once per Llama for each argument it accepts without honouring."""

    def __init__(self):
        self._seen: set[str] = set()

    def warn(self, name: str, message: str) -> None:
        """Issue message as a UserWarning unless name has warned already."""
        if name not in self._seen:
            self._seen.add(name)
            warnings.warn(message, UserWarning, stacklevel=4)

    def constructor_args(self, given: dict[str, Any]) -> None:
        """Warn for each given argument that is unknown, or known but not honoured."""
        for name, value in given.items():
            if name in NEUTRAL_ARGS:
                continue
            if name in UNUSED_ARGS:
                neutral, why = UNUSED_ARGS[name]
                if value != neutral:
                    self.warn(name, f"Llama({name}={value!r}) is accepted but has no effect: {why}")
            else:
                self.warn(name, f"Llama(): unknown argument {name!r} is ignored")

    def sampling_args(self, **given: Any) -> None:
        """Warn for each sampler we lack that a call asked for (mirostat, typical_p, tfs_z)."""
        for name, value in given.items():
            if value is not None and value != UNUSED_SAMPLING[name]:
                self.warn(name, f"{name}={value!r} is not implemented by this sampler and is ignored "
                                "(top_k, top_p, min_p, temperature and the penalties are)")


def kv_cache_type_of(type_k: int | None, type_v: int | None, default: str) -> str:
    """Our kv_cache_type for llama.cpp's type_k/type_v GGML type ids; ValueError when
    they differ (one type holds both) or name a type the pool cannot store."""
    given = {t for t in (type_k, type_v) if t is not None}
    if not given:
        return default
    if len(given) > 1:
        raise RequestError(f"type_k {type_k} and type_v {type_v} differ; the paged KV cache stores K and V "
                           "in one type")
    (ggml_type,) = given
    if ggml_type not in _KV_TYPES:
        name = _GGML_TYPE_NAMES.get(ggml_type, "unknown")
        raise RequestError(f"KV cache type {ggml_type} ({name}) is not supported; use 1 (F16), 8 (Q8_0) "
                           "or 2 (Q4_0)")
    return _KV_TYPES[ggml_type]


def seed_of(seed: int | None) -> int | None:
    """None (a random seed per generation) for llama.cpp's default seed or -1."""
    return None if seed is None or seed in (LLAMA_DEFAULT_SEED, -1) else seed


@dataclass(eq=False, repr=False)   # compared by identity, like llama-cpp-python's (it holds arrays)
class LlamaState:
    """What save_state returns and load_state takes: the tokens the model has
    evaluated. NOTE(state): no KV bytes are stored (llama_state is b""): a
    request's answer never depends on saved KV here, and the paged pool's prefix
    cache holds recent prefixes, so restoring the tokens is exact and a later
    generation recomputes only what the cache no longer holds."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes = b""
    llama_state_size: int = 0
    seed: int | None = None


LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]
StoppingCriteria = Callable[[np.ndarray, np.ndarray], bool]


class LogitsProcessorList(List[LogitsProcessor]):
    """Processors applied in order to each row of logits before sampling."""

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(List[StoppingCriteria]):
    """Generation stops when any criterion says so."""

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return any([criterion(input_ids, logits) for criterion in self])


class MinTokensLogitsProcessor:
    """Forbids the end-of-sequence token until min_tokens have been generated."""

    def __init__(self, min_tokens: int, token_eos: int):
        self.min_tokens = min_tokens
        self.token_eos = token_eos
        self.prompt_tokens: Optional[int] = None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        if len(input_ids) - self.prompt_tokens < self.min_tokens:
            scores[self.token_eos] = -np.inf
        return scores


class LlamaTokenizer:
    """llama-cpp-python's tokenizer view of a Llama (Llama.tokenizer() returns one)."""

    def __init__(self, llama):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of UTF-8 text."""
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: Optional[list[int]] = None,
                   special: bool = False) -> bytes:
        """UTF-8 bytes of token ids."""
        return self._llama.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of a str."""
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        """The str of token ids."""
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


class LlamaRAMCache:
    """Accepted by Llama.set_cache for compatibility: the paged pool's prefix cache
    already keeps recent prompts' KV (shared pages, LRU), so this holds nothing."""

    def __init__(self, capacity_bytes: int = 2 << 30):
        self.capacity_bytes = capacity_bytes


LlamaCache = LlamaRAMCache


@dataclass
class StopWatch:
    """A logits processor that records the raw row (and the ids before it) of each
    step, so stopping criteria can be asked after the token is drawn, as
    llama-cpp-python asks them. Rows are queued: another thread sharing the steps
    may run the next step before this request's caller reads the token."""

    inner: Optional[LogitsProcessor] = None
    rows: deque = field(default_factory=deque)   # (input_ids, scores) per drawn token, oldest first

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        self.rows.append((input_ids, scores.copy()))
        return self.inner(input_ids, scores) if self.inner is not None else scores

    def next_row(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The oldest recorded row not yet asked about (None if none)."""
        return self.rows.popleft() if self.rows else None
