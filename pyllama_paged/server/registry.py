"""The models a server offers: each a GGUF file with its tokenizer, chat
template and its own engine loop, found by a user-facing name."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..tokenizer.chat_template import ChatTemplate
from ..engine.model_runner import ModelRunner, dense_kv_bytes_per_token
from ..engine.loop import EngineLoop
from ..engine.llm_engine import LLMEngine
from ..engine.encoder import encoder_engine
from ..engine.model import Model, default_model_path
from ..engine.scheduler import SchedulerConfig
from ..tokenizer.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "gemma3:270m"


@dataclass
class EngineOptions:
    paged: bool = True
    n_ctx: int = 4096
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_batch: int = 512
    block_size: int = 32
    kv_cache_type: str = "f16"
    kv_budget_tokens: int = 32768       # the KV pool, in tokens of every layer, shared by all users
    kv_budget_bytes: int | None = None  # the KV pool in bytes (wins over kv_budget_tokens)
    max_num_seqs: int = 64
    preemption_mode: str = "recompute"
    itl_budget: float | str | None = "auto"   # seconds, "auto" or None (see SchedulerConfig)
    max_prefill_tokens_with_decodes: int | None = 128   # a ceiling under the budget, and before it is learned


@dataclass
class ServedModel:
    name: str
    path: str
    model: Model
    tokenizer: Tokenizer
    template: ChatTemplate | None      # None: an embedding model (it cannot chat)
    runner: ModelRunner
    loop: EngineLoop
    loaded_at: float = field(default_factory=time.time)
    keep_alive: float | None = None      # the last request's keep_alive in seconds (None: forever)
    last_used: float = field(default_factory=time.time)

    def expires_at(self) -> str:
        """Ollama's expires_at: when keep_alive would let the model go (never: far future)."""
        if self.keep_alive is None or self.keep_alive < 0:
            return "2318-01-01T00:00:00Z"
        when = dt.datetime.fromtimestamp(self.last_used + self.keep_alive, dt.timezone.utc)
        return when.isoformat().replace("+00:00", "Z")

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

    @property
    def size(self) -> int:
        return os.path.getsize(self.path)

    @property
    def digest(self) -> str:
        st = os.stat(self.path)
        return hashlib.sha256(f"{self.path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()

    def details(self) -> dict:
        cfg = self.model.config
        file_type = self.model.metadata.get("general.file_type")
        return {"format": "gguf", "family": cfg.arch, "families": [cfg.arch],
                "parameter_size": str(self.model.metadata.get("general.size_label", "")),
                "quantization_level": _FILE_TYPES.get(file_type, str(file_type))}

    def close(self) -> None:
        self.loop.stop()
        self.runner.close()
        self.model.close()


_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 7: "Q8_0", 8: "Q5_0", 15: "Q4_K_M", 17: "Q5_K_M",
               18: "Q6_K", 32: "BF16"}


def model_name_for(path: str) -> str:
    """The name a user types for a file: its stem, lower-cased."""
    return Path(path).stem.lower()


class ModelRegistry:
    """Name -> ServedModel; names also match with an Ollama-style ':latest' suffix."""

    def __init__(self, paths: list[str] | None, options: EngineOptions):
        self.options = options
        self.models: dict[str, ServedModel] = {}
        self.aliases: dict[str, str] = {}     # a name made with copy/create -> a served model's name
        if not paths:
            self._load(DEFAULT_MODEL_NAME, default_model_path())
        for path in paths or []:
            self._load(model_name_for(path), path)

    def _load(self, name: str, path: str) -> None:
        o = self.options
        model = Model(path)
        if model.config.is_encoder:   # an embedding model: no KV pool, no chat template
            runner, engine = encoder_engine(model, o.n_threads)
            self.models[name] = ServedModel(name, str(path), model, Tokenizer.from_metadata(model.metadata), None,
                                            runner, EngineLoop(engine))
            return
        n_ctx = min(o.n_ctx, model.config.n_ctx_train)
        # Bytes are what users size; a budget in tokens is that many tokens of every layer
        # (sliding-window groups then hold more tokens in the same bytes).
        kv_bytes = o.kv_budget_bytes or o.kv_budget_tokens * dense_kv_bytes_per_token(model.config, o.kv_cache_type)
        if o.paged:
            runner = ModelRunner(model, paged=True, n_ctx=n_ctx, n_threads=o.n_threads, n_batch=o.n_batch,
                            block_size=o.block_size, kv_cache_type=o.kv_cache_type, kv_bytes=kv_bytes)
        else:
            slab_bytes = n_ctx * dense_kv_bytes_per_token(model.config, o.kv_cache_type)
            runner = ModelRunner(model, paged=False, n_ctx=n_ctx, n_threads=o.n_threads, n_batch=o.n_batch,
                            kv_cache_type=o.kv_cache_type, n_seq_max=max(1, kv_bytes // slab_bytes))
        tokenizer = Tokenizer.from_metadata(model.metadata)
        loop = EngineLoop(LLMEngine(runner, tokenizer.eot_ids, SchedulerConfig(
            max_num_batched_tokens=o.n_batch, max_num_seqs=o.max_num_seqs, preemption_mode=o.preemption_mode,
            itl_budget=o.itl_budget, max_prefill_tokens_with_decodes=o.max_prefill_tokens_with_decodes)))
        self.models[name] = ServedModel(name, str(path), model, tokenizer,
                                        ChatTemplate.for_model(model.metadata, model.config.arch), runner, loop)

    def get(self, name: str | None) -> ServedModel | None:
        """The model for a requested name (None or '' means the first one)."""
        if not name:
            return next(iter(self.models.values()))
        name = name.lower()
        for candidate in (name, name[:-7] if name.endswith(":latest") else None):
            if candidate in self.models:
                return self.models[candidate]
            if candidate in self.aliases:
                return self.models[self.aliases[candidate]]
        return None

    def names(self) -> list[str]:
        return list(self.models) + list(self.aliases)

    def add_alias(self, name: str, target: str) -> None:
        """Another name for a served model (Ollama's copy and create); ValueError if taken."""
        name = name.lower().removesuffix(":latest")
        served = self.get(target)
        if served is None:
            raise ValueError(f"model '{target}' not found")
        if name in self.models or not name:
            raise ValueError(f"'{name}' is already the name of a served model")
        self.aliases[name] = served.name

    def remove_alias(self, name: str) -> bool:
        """Drop a name made with add_alias; False if name is not one."""
        return self.aliases.pop(name.lower().removesuffix(":latest"), None) is not None

    def close(self) -> None:
        for m in self.models.values():
            m.close()
