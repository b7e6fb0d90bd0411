"""EngineConfig: everything that builds one engine (the model file and how its weights
load, its KV cache, the compute context, the scheduler, speculative decoding, the prefix
cache's tiers), in one place, so the Python API, the server and the benchmarks wire an
engine the same way (load_model, LLMEngine.from_config, build_engine). A field with a flag
is an option of `pyllama-paged run|chat|serve`; the groups' are serve's."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PagedError
from ..flags import flagged, group
from .sched.scheduler import SchedulerConfig
from .kv.prefix_tiers import PrefixTierConfig
from .spec_decode.draft import SpeculativeConfig
from .worker.model_runner import KV_TYPES
from .worker.thread_policy import MAX_THREADS, default_threads


@dataclass
class EngineConfig:
    """One engine's settings. The KV budget is, first match: num_blocks (paged: exactly
    that many pages), kv_bytes, kv_tokens tokens of every layer, else n_seq_max
    sequences of n_ctx tokens. paged=False spends the same budget on whole n_ctx slabs.
    A flagged field is an option of `pyllama-paged run|chat|serve` (cli.py, flags.py)."""

    # fields __post_init__ resolves (the thread count not given: the CPUs, each step adapting);
    # an option shows their declared default, and settings made again from flags resolve them anew
    RESOLVED_FIELDS = ("n_threads", "adapt_threads")

    model_path: str | None = flagged(None, "--model", "GGUF file, or the name of a pulled or embedded model "
                                     "(default: for run the embedded base model gemma3:270m-base, which continues "
                                     "text; for chat the embedded chat model smollm2:135m)", aliases=("-m",),
                                     metavar="MODEL")
    mmproj: str | None = flagged(None, "--mmproj", "vision projector GGUF (llama.cpp's mmproj file) for the "
                                 "model: images in prompts", metavar="FILE")
    # <= 0: the model's training context (never more than it)
    n_ctx: int = flagged(4096, "--ctx", "context length in tokens, per sequence", type=int)
    n_batch: int = 512                  # tokens per forward step
    n_threads: int | None = flagged(
        None, "--threads", f"CPU threads, exactly, 1 to {MAX_THREADS} (default: each step on the cores free at "
        "the time, at most every CPU this process may use)", type=int, aliases=("-t",))
    adapt_threads: bool = False         # with n_threads given: each step on the cores free now, at most that many
    paged: bool = flagged(True, "--no-paged", "a contiguous KV slab per sequence instead of pages",
                          action="store_false")
    block_size: int = flagged(32, "--block-size", "KV page size in tokens", type=int)
    kv_cache_type: str = flagged("f16", "--kv-type", "KV cache type", choices=tuple(KV_TYPES))
    num_blocks: int | None = None
    kv_bytes: int | None = None
    kv_tokens: int | None = None
    n_seq_max: int = 1
    # a hybrid model's (Qwen3.5/3.6) recurrent state slots for running sequences (None: out of the
    # KV budget, engine/kv/state_pool.py's split_budget), and those kept for prefix-cache
    # checkpoints beside them, out of the same budget (0: its prefix cache is never hit)
    state_slots: int | None = None
    state_checkpoints: int = flagged(2, "--state-checkpoints", "hybrid models (Qwen3.5/3.6): recurrent states kept at "
                                     "block boundaries for prefix-cache hits, out of the KV budget (0: none)", type=int)
    # ... and one kept every this many blocks of a long prompt's prefill (a shared system
    # prompt), each until least recently used (0: a prompt keeps its last full block's alone)
    state_checkpoint_every: int = flagged(0, "--state-checkpoint-every", "hybrid models: also keep a state every "
                                          "this many blocks of a long prompt's prefill (0: none)", type=int)
    free_window_blocks: bool = True     # sliding-window layers give pages back (per-layer-group paging)
    attention: str = "kernel"           # "kernel": our CPU operator; "gather": GGML ops alone
    repack_weights: bool = flagged(True, "--no-repack", "keep GGML's weight layout (no interleaved CPU repacking): "
                                   "batch-invariant products where our panels do not run", action="store_false")
    pack_panels: bool | str = True
    n_gpu_layers: int = flagged(0, "--gpu-layers", "layers on the GPU, the last ones first (-1 or more than "
                                "the model has: all, and the output head); needs a GGML built for a GPU, see "
                                "the README", type=int, aliases=("-ngl",))
    main_gpu: int = flagged(0, "--main-gpu", "which of GGML's GPUs, counted from 0", type=int)
    scheduler: SchedulerConfig = group(SchedulerConfig, default_factory=SchedulerConfig)
    # speculative decoding (None: off; --speculative or --draft-model turn it on)
    speculative: SpeculativeConfig | None = group(SpeculativeConfig, build=SpeculativeConfig.from_options,
                                                  switches=("method", "draft_model"))
    # host-RAM / disk tiers below the prefix cache (None: off)
    prefix_tiers: PrefixTierConfig | None = group(PrefixTierConfig, build=PrefixTierConfig.from_options)

    def __post_init__(self):
        if self.n_threads is None:
            self.n_threads, self.adapt_threads = default_threads(), True
        for name in ("n_batch", "n_threads", "n_seq_max", "block_size"):
            if getattr(self, name) < 1:
                raise PagedError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.state_slots is not None and self.state_slots < 1:
            raise PagedError(f"EngineConfig.state_slots must be >= 1 or None, got {self.state_slots}")
        if self.state_checkpoint_every < 0:
            raise PagedError(f"EngineConfig.state_checkpoint_every must be >= 0, got {self.state_checkpoint_every}")
        if self.state_checkpoints < 0:
            raise PagedError(f"EngineConfig.state_checkpoints must be >= 0, got {self.state_checkpoints}")
        for name in ("num_blocks", "kv_bytes", "kv_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PagedError(f"EngineConfig.{name} must be >= 1 or None, got {value}")

    def context_for(self, n_ctx_train: int) -> int:
        """The context a model trained on n_ctx_train tokens runs with here."""
        return min(self.n_ctx, n_ctx_train) if self.n_ctx > 0 else n_ctx_train

    @property
    def kv_budget_given(self) -> bool:
        """Whether the KV budget was set explicitly (else it is n_seq_max sequences of n_ctx)."""
        return self.num_blocks is not None or self.kv_bytes is not None or self.kv_tokens is not None

    def kv_budget_bytes(self, n_ctx: int, dense_bytes_per_token: int) -> int:
        """The KV budget in bytes (dense_bytes_per_token: one token of every layer)."""
        if self.kv_bytes is not None:
            return self.kv_bytes
        if self.kv_tokens is not None:
            return self.kv_tokens * dense_bytes_per_token
        return n_ctx * self.n_seq_max * dense_bytes_per_token
