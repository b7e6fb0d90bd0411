"""Command line: `pyllama-paged run|chat|serve|info|pull`."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import PagedError


def _options_of(*settings: type) -> list:
    """The fields of these settings dataclasses that are options (a flag in their metadata)."""
    import dataclasses

    return [f for cls in settings for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _add_field_options(p: argparse.ArgumentParser, fields: list, none_means: str | None = None) -> None:
    """One option per field, as its metadata says (flag, help, argparse's settings); the field's
    name is the option's dest. none_means: how the help says a default of None."""
    for f in fields:
        settings = dict(f.metadata)
        flag, help_text, aliases = settings.pop("flag"), settings.pop("help"), settings.pop("aliases", ())
        shown = none_means if f.default is None else f.default
        if "action" not in settings:
            if "choices" not in settings:   # named after the flag, as argparse names an option without dest
                settings.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
            if shown is not None:
                help_text += f" (default {shown})"
        p.add_argument(flag, *aliases, dest=f.name, default=f.default, help=help_text, **settings)


def _engine_options() -> list:
    """The engine options of run and chat: EngineConfig's fields with a flag, each also the
    Llama argument of the same name."""
    from .engine.config import EngineConfig

    return _options_of(EngineConfig)


_GPU_OPTIONS = ("n_gpu_layers", "main_gpu")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, or the name of a pulled model (default: the embedded Gemma 3 270M, a base "
                        "model: it continues text, it does not follow instructions)")
    _add_field_options(p, _engine_options())


def _add_gpu_args(p: argparse.ArgumentParser) -> None:
    _add_field_options(p, [f for f in _engine_options() if f.name in _GPU_OPTIONS])


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for answers that repeat (default: a new one each run)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-text token, up to --max-tokens")


def _require_gpu(args) -> None:
    """--gpu-layers on a machine whose GGML lists no GPU is an error here (Llama only warns)."""
    if args.n_gpu_layers:
        from .engine.worker.devices import gpu_device

        gpu_device(args.main_gpu)


def _max_tokens(text: str) -> int:
    """-n: a count of tokens >= 1, or -1 for "to the end of the context" (llama.cpp's -n -1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of tokens") from None
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value}: give a number of tokens >= 1, or -1 for no limit "
                                         "but the context")
    return value


def _model_path(name: str | None) -> str | None:
    """--model as a file, or the GGUF of a pulled model's name; a clear error otherwise."""
    import os

    if name is None or os.path.isfile(name):
        return name
    if os.path.isdir(name):
        found = sorted(f for f in os.listdir(name) if f.lower().endswith(".gguf"))
        hint = f" (it holds {', '.join(found[:3])})" if found else " (it holds no .gguf file)"
        raise PagedError(f"--model {name}: a directory; give a GGUF file{hint}")
    from .models.store import ModelStore

    stored = ModelStore().find_name(name)
    if stored is not None:
        return stored.path
    raise PagedError(f"--model {name}: no such file, and no pulled model of that name "
                     "(`pyllama-paged pull NAME` fetches one)")


def _open_llama(args):
    """The Llama that run and chat use, from the engine flags."""
    from .api.llama import Llama

    _require_gpu(args)
    if args.n_ctx < args.block_size:
        raise PagedError(f"--ctx {args.n_ctx} is smaller than one KV page (--block-size {args.block_size}): "
                         f"give --ctx {args.block_size} or more")
    return Llama(_model_path(args.model), **{f.name: getattr(args, f.name) for f in _engine_options()})


def _limit(max_tokens: int) -> int | None:
    """-n as the API's max_tokens (None: to the end of the context)."""
    return None if max_tokens == -1 else max_tokens


def cmd_run(args) -> int:
    with _open_llama(args) as llm:
        start = time.perf_counter()
        n = 0
        for chunk in llm.create_completion(args.prompt, max_tokens=_limit(args.max_tokens),
                                           temperature=args.temperature, top_k=args.top_k,
                                           top_p=args.top_p, seed=args.seed, stream=True,
                                           ignore_eos=args.ignore_eos):
            sys.stdout.write(chunk["choices"][0]["text"])
            sys.stdout.flush()
            if "usage" in chunk:
                n = chunk["usage"]["completion_tokens"]
        elapsed = time.perf_counter() - start
        sys.stdout.write("\n")
        print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


def _utilization(stats: dict) -> str:
    """How full the pages in use are (none in use: nothing to say)."""
    if not stats["blocks_used"]:
        return "no pages in use"
    return f"pages in use {stats['utilization']:.1%} full"


def _print_stats(llm, last_rate: float | None) -> None:
    s = llm.stats()
    if "blocks_cached" in s:
        print(f"[pages: {s['blocks_used']} used, {s['blocks_free']} free, {s['blocks_shared']} shared, "
              f"{s['blocks_cached']} cached of {s['blocks_total']} x {s['block_size']} tokens; "
              f"{_utilization(s)}; prefix-cache hit rate {s['prefix_hit_rate']:.1%}]")
        groups = s.get("kv_groups") or []
        if len(groups) > 1:
            print(f"[KV {s['kv_bytes_used'] / 2**20:.1f} of {s['kv_pool_bytes'] / 2**20:.1f} MiB in "
                  f"{len(groups)} layer groups; pages past a window go back to the pool]")
    else:
        print(f"[slabs: {s['blocks_used']} used, {s['blocks_free']} free of {s['blocks_total']}]")
    rate = f"{last_rate:.1f} tokens/s" if last_rate else "n/a"
    print(f"[generated {s['generated_tokens']} tokens, computed {s['computed_tokens']}; last answer {rate}]")


BASE_MODEL_NOTE = ("note: the default model (Gemma 3 270M) is a base model, not tuned to follow instructions: "
                   "it continues your text rather than answering it, and may repeat itself. For a chat model: "
                   "`pyllama-paged pull gemma3:270m`, then `pyllama-paged chat --model gemma3:270m`.")


class ThinkingWriter:
    """A streamed answer's thinking, apart from its text: dimmed on a terminal, after a
    "[thinking]" label where a program or a file reads the output, or left out (hide)."""

    DIM, RESET = "\033[2m", "\033[0m"

    def __init__(self, out, hide: bool):
        self.out, self.hide, self.tty = out, hide, out.isatty()
        self.open = False

    def write(self, thinking: str) -> None:
        """A piece of thinking (the block begun first)."""
        if self.hide or not thinking:
            return
        if not self.open:
            self.open = True
            self.out.write(self.DIM if self.tty else "[thinking] ")
        self.out.write(thinking)

    def close(self, gap: str = "\n\n") -> None:
        """The end of the thinking: the dimming ended, then gap (before the answer)."""
        if self.open:
            self.open = False
            self.out.write((self.RESET if self.tty else "") + gap)


def cmd_chat(args) -> int:
    with _open_llama(args) as llm:
        if args.model is None:
            print(BASE_MODEL_NOTE, flush=True)
        history: list[dict] = []
        if args.system:
            history.append({"role": "system", "content": args.system})
        last_rate = None
        print("pyllama-paged chat: /reset clears the history, /stats shows the KV pool, "
              "/exit quits; Ctrl-C stops an answer.", flush=True)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history = history[:1] if args.system else []
                print("[history cleared]", flush=True)
                continue
            if text == "/stats":
                _print_stats(llm, last_rate)
                continue
            history.append({"role": "user", "content": text})
            answer, n_tokens = [], 0
            start = time.perf_counter()
            stream = llm.create_chat_completion(history, max_tokens=_limit(args.max_tokens),
                                                temperature=args.temperature, seed=args.seed, stream=True,
                                                ignore_eos=args.ignore_eos)
            thinking = ThinkingWriter(sys.stdout, args.hide_thinking)
            try:
                for chunk in stream:
                    for choice in chunk["choices"]:
                        thinking.write(choice["delta"].get("reasoning_content", ""))
                        piece = choice["delta"].get("content", "")
                        if piece:
                            thinking.close()
                        answer.append(piece)
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                    if "usage" in chunk:
                        n_tokens = chunk["usage"]["completion_tokens"]
            except KeyboardInterrupt:
                stream.close()   # aborts the request: its pages go back to the pool
                thinking.close("")
                print("\n[stopped]", flush=True)
            else:
                thinking.close("")
                print(flush=True)
            elapsed = time.perf_counter() - start
            last_rate = n_tokens / elapsed if n_tokens and elapsed > 0 else None
            history.append({"role": "assistant", "content": "".join(answer)})


def _itl_budget(text: str) -> float | str | None:
    """--itl-budget-ms: 'auto', 'off' (or 0), or milliseconds."""
    if text == "auto":
        return "auto"
    if text == "off":
        return None
    try:
        ms = float(text)
    except ValueError:
        raise SystemExit(f"--itl-budget-ms must be 'auto', 'off' or milliseconds, got {text!r}") from None
    if ms < 0:
        raise SystemExit(f"--itl-budget-ms must be >= 0, got {text!r}")
    return ms / 1000 if ms > 0 else None


def serve_settings(args) -> tuple:
    """(EngineOptions, Limits, API key, extra origins) from `serve`'s arguments and environment."""
    import dataclasses
    import os

    from .server.app import ORIGINS_ENV, origins_from
    from .server.generation import Limits
    from .engine.worker.thread_policy import MAX_THREADS
    from .server.registry import EngineOptions

    if args.n_threads is not None and not 1 <= args.n_threads <= MAX_THREADS:
        raise SystemExit(f"--threads must be between 1 and {MAX_THREADS} (the native sampler's limit), "
                         f"got {args.n_threads}")
    if args.max_loaded_models < 1:
        raise SystemExit(f"--max-loaded-models must be >= 1, got {args.max_loaded_models}")
    # the options that are fields, by name; then those whose text is not one field's value
    budget = {} if args.kv_budget is None else dict(zip(("kv_tokens", "kv_bytes"), args.kv_budget))
    options = EngineOptions(**{f.name: getattr(args, f.name) for f in _serve_options()}, **budget,
                            itl_budget=_itl_budget(args.itl_budget_ms),
                            speculative=_speculative(args), prefix_tiers=_prefix_tiers(args))
    _allow_pulls(args)
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    api_key = args.api_key or os.environ.get("PYLLAMA_API_KEY") or None
    origins = origins_from(os.environ.get(ORIGINS_ENV)) + origins_from(args.origins)
    return options, limits, api_key, origins


def _serve_options() -> list:
    """serve's options that are fields: EngineOptions' (EngineConfig's and the server's own)
    and the scheduler's."""
    from .engine.sched.scheduler import SchedulerConfig
    from .server.registry import EngineOptions

    return _options_of(EngineOptions, SchedulerConfig)


def _kv_budget_help() -> str:
    """--kv-budget's help, with the server's default pool."""
    from .server.registry import ServedEngineConfig

    return ("KV pool size: bytes with a unit (512MiB, 1.5GiB, 84MB) or a number of tokens of every layer "
            f"(default {ServedEngineConfig.kv_tokens})")


def _allow_pulls(args) -> None:
    """--pull-allow: the hosts added to what pulls may reach, for this process and its children
    (models.egress reads them from the environment at each pull)."""
    import os

    from .models.egress import PULL_ALLOW_ENV

    added = [h.strip() for h in (args.pull_allow or "").split(",") if h.strip()]
    if added:
        os.environ[PULL_ALLOW_ENV] = ",".join(filter(None, [os.environ.get(PULL_ALLOW_ENV, ""), *added]))


def _add_pull_allow(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pull-allow", default=None, metavar="HOST[:PORT],...",
                   help="hosts pulls may use besides the configured registry (PYLLAMA_PAGED_REGISTRY) and the "
                        "Hugging Face Hub, comma-separated (also PYLLAMA_PAGED_PULL_ALLOW); a host named here may "
                        "be on a private or loopback address (docs/models.md)")


def _prefix_tiers(args):
    """serve's prefix-cache tier flags as a PrefixTierConfig (None: no tier)."""
    from .engine.kv.block_store import check_directory
    from .engine.kv.prefix_tiers import PrefixTierConfig

    if args.cache_ram < 0:
        raise SystemExit(f"--cache-ram must be >= 0 MiB, got {args.cache_ram}")
    try:
        disk_bytes = parse_bytes(args.prefix_cache_disk)
    except argparse.ArgumentTypeError:
        raise SystemExit(f"--prefix-cache-disk must be a size such as 16GiB, got {args.prefix_cache_disk!r}") \
            from None
    try:
        config = PrefixTierConfig(ram_bytes=args.cache_ram << 20, disk_dir=args.prefix_cache_dir,
                                  disk_bytes=disk_bytes, disk_group=args.prefix_cache_group)
        if config.disk_dir is not None:   # at startup, not at the first request's model load
            check_directory(config.disk_dir, config.disk_group)
    except PagedError as e:
        raise SystemExit(f"--prefix-cache-dir / --prefix-cache-disk: {e}") from None
    return config if config.enabled else None


def _speculative(args):
    """serve's speculative-decoding flags as a SpeculativeConfig (None: off)."""
    from .engine.spec.draft import SpeculativeConfig
    from .errors import PagedError

    method = args.speculative
    if method is None and args.draft_model is not None:
        method = "draft_model"   # --draft-model alone says which method
    if method is None:
        return None
    try:
        if method == "draft_model":
            return SpeculativeConfig(method=method, num_draft_tokens=args.num_draft_tokens,
                                     draft_model=args.draft_model)
        if args.draft_model is not None:
            raise PagedError(f"--draft-model is for --speculative draft_model, not {method}")
        return SpeculativeConfig(method=method, num_draft_tokens=args.num_draft_tokens,
                                 max_ngram=args.max_ngram)
    except PagedError as e:
        raise SystemExit(str(e)) from None


def cmd_serve(args) -> int:
    from .server.app import serve

    if args.ray:
        return serve_on_ray(args)
    options, limits, api_key, origins = serve_settings(args)
    serve(args.model, args.host, args.port, api_key, options, limits, origins, kv_events_settings(args),
          args.drain_seconds)
    return 0


def serve_on_ray(args) -> int:
    """`serve --ray ADDRESS`: the server as replicas on a Ray cluster, through Ray Serve."""
    try:
        from .server.scale_out.ray_app import ScaleOut, run_on_ray
    except ImportError as e:
        raise SystemExit(f"--ray needs Ray Serve: pip install 'pyllama-paged[ray]' ({e})") from None
    if args.kv_events:
        raise SystemExit("--kv-events publishes one server's cache; with --ray each replica would need an "
                         "endpoint of its own (not supported yet)")
    cpus = args.replica_cpus if args.replica_cpus is not None else float(args.n_threads or 1)
    if args.n_threads is None:   # a replica's threads are its reserved CPUs, not the driver machine's
        args.n_threads = max(1, int(cpus))
    options, limits, api_key, origins = serve_settings(args)
    scale = ScaleOut(replicas=args.replicas, replica_cpus=cpus, replica_memory=args.replica_memory,
                     router=args.ray_router, prefix_chars=args.route_prefix_chars, imbalance=args.route_imbalance,
                     max_ongoing_requests=args.max_num_seqs, graceful_shutdown_timeout_s=args.replica_drain_seconds)
    return run_on_ray(args.ray, args.host, args.port, options, limits, scale, args.model, api_key, origins)


def parse_bytes(text: str) -> int:
    """A size flag (--replica-memory, --prefix-cache-disk): with a unit (2GiB) or a number of bytes."""
    tokens, size = parse_kv_budget(text)
    return size if size is not None else tokens


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    """`serve --ray`'s options (the optional extra pyllama-paged[ray]; docs/scale-out.md)."""
    g = p.add_argument_group("scale out on Ray Serve (docs/scale-out.md)")
    g.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run replicas of this server on the Ray cluster at ADDRESS (its head's host:port, or "
                        "'auto') through Ray Serve; --host/--port are then Serve's HTTP proxy")
    g.add_argument("--replicas", type=int, default=2, help="replicas, each one engine and KV pool per model")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="Ray CPUs reserved per replica (default: --threads, else 1; --threads defaults to it)")
    g.add_argument("--replica-memory", type=parse_bytes, default=None,
                   help="memory Ray reserves per replica (2GiB, 512MiB or bytes)")
    g.add_argument("--ray-router", default="prefix",
                   help="replica choice: prefix (prefix-cache affinity), round_robin, pow2 (Serve's default), "
                        "or a RequestRouter's import path")
    g.add_argument("--route-prefix-chars", type=int, default=1024,
                   help="leading characters of the prompt (system prompt first) that prefix routing hashes")
    g.add_argument("--route-imbalance", type=int, default=8,
                   help="requests in flight the preferred replica may have beyond the least loaded one before "
                        "prefix routing passes it over")
    g.add_argument("--replica-drain-seconds", type=float, default=60.0,
                   help="on stop, how long a replica may take to finish its requests")


def kv_events_settings(args):
    """The KVEventsConfig of `serve --kv-events ...`, or None when events are off."""
    if not args.kv_events:
        return None
    from .server.scale_out.kv_events import KVEventsConfig

    return KVEventsConfig(endpoint=args.kv_events, replay_endpoint=args.kv_events_replay,
                          topic=args.kv_events_topic, format=args.kv_events_format,
                          bind=args.kv_events_bind, token_ids=args.kv_events_token_ids)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """One option per Limits field: the flag and help live beside the field (server/generation.py)."""
    from .server.generation import Limits

    _add_field_options(p, _options_of(Limits), none_means="the model's context")


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_kv_budget(text: str) -> tuple[int | None, int | None]:
    """--kv-budget: (tokens, None) for a plain number, (None, bytes) for a size with a unit."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _UNITS) or (not unit and "." in m.group(1)):
        raise argparse.ArgumentTypeError(f"'{text}' is neither a number of tokens nor a size like 512MiB "
                                         f"(units: {', '.join(_UNITS)})")
    if not unit:
        value = int(m.group(1))
        if value < 1:
            raise argparse.ArgumentTypeError("the KV budget must be at least 1 token")
        return value, None
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError("the KV budget must be at least 1 byte")
    return None, size


def cmd_info(args) -> int:
    from .engine.worker.model import Model
    from .engine.kv.groups import KVGroups
    from .engine.worker.model_runner import KV_TYPES, dense_kv_bytes_per_token

    model = Model(args.path, n_gpu_layers=args.n_gpu_layers, main_gpu=args.main_gpu)
    cfg = model.config
    print(f"file: {model.path}")
    for key, value in model.metadata.items():
        if key.startswith("tokenizer.ggml.") and isinstance(value, (list, tuple)) or hasattr(value, "shape"):
            value = f"[{len(value)} entries]"
        # strings that are not UTF-8 (kept lossless by the reader) print as escapes
        print(f"  {key} = {value}".encode("utf-8", "backslashreplace").decode("utf-8"))
    print(f"config: {cfg}")
    groups = KVGroups.for_windows(cfg.layer_window)
    if cfg.is_encoder:
        print(f"encoder-only ({cfg.arch}): embeddings with {cfg.pooling} pooling, no KV cache")
    for kv_type in KV_TYPES if not cfg.is_encoder else ():
        dense = dense_kv_bytes_per_token(cfg, kv_type)
        per_group = dense // groups.n_groups
        line = f"KV bytes per token ({kv_type}): {dense} for a short sequence"
        if groups.window_groups:
            windows = sorted({w for w in groups.group_window if w > 0})
            full = groups.n_groups - groups.window_groups
            line += (f"; past the window{'s' if len(windows) > 1 else ''} ({', '.join(map(str, windows))} tokens) "
                     f"{full * per_group} (the {full * groups.layers_per_group} full-attention layers; "
                     f"the {groups.window_groups * groups.layers_per_group} sliding-window layers stop growing)")
        print(line)
    if cfg.is_hybrid:
        from .engine.kv.state_pool import state_bytes_per_sequence
        n_linear = sum(cfg.layer_recurrent)
        print(f"recurrent state per sequence: {state_bytes_per_sequence(model.native)} bytes (f32, its "
              f"{n_linear} Gated DeltaNet layers; KV only in the {cfg.n_attention_layers} full-attention layers), "
              "the same per prefix-cache checkpoint")
    from ._native import ffi, lib
    build = ffi.string(lib.pp_ggml_build_info()).decode()
    print(f"GGML: {build}")
    # tinyBLAS only runs GGML's own products: it matters for the weights our panels do not take
    n_matmuls = model.config.n_layer * 7 + 1
    if "llamafile=0" in build and model.n_panel_packed < n_matmuls:
        print(f"  (this GGML lacks its tinyBLAS prompt GEMM, and {n_matmuls - model.n_panel_packed} of the "
              f"{n_matmuls} weight products run on GGML's kernels here: rebuilding GGML with -DGGML_LLAMAFILE=ON "
              "makes their prompt processing faster; see vendor/README.md)")
    print(f"weights repacked for GGML's CPU GEMM: {model.n_repacked}")
    print(f"weights in our panel GEMMs: {model.n_panel_packed} (kernel: {model.panel_kernel})")
    _print_devices(model)
    model.close()
    return 0


def _print_devices(model) -> None:
    from .engine.worker.devices import list_devices

    print("devices (GGML):")
    for d in list_devices():
        print(f"  {d.index}: {d.name} ({d.type}) {d.description}; {d.memory_free / 2**20:.0f} MiB free of "
              f"{d.memory_total / 2**20:.0f}")
    if model.config.is_encoder:
        print("layers: all on the CPU (an encoder-only model)")
        return
    *layers, head = model.layer_placement()
    start = 0
    for il in range(1, len(layers) + 1):   # consecutive layers on one device, as one line
        if il == len(layers) or layers[il] != layers[start]:
            span = f"layer {start}" if il - 1 == start else f"layers {start}-{il - 1}"
            print(f"  {span}: {layers[start]}")
            start = il
    print(f"  output head: {head}")
    if model.device is not None:
        print(f"  weights on {model.device.name}: {model.device_bytes / 2**20:.1f} MiB")


def cmd_pull(args) -> int:
    from .models.progress import TerminalProgress
    from .models.pull import pull

    _allow_pulls(args)
    bar = TerminalProgress()
    try:
        stored = pull(args.reference, args.file, progress=bar)
    finally:
        bar.close()
    print(f"pulled {stored.name}: {stored.path}", file=sys.stderr)
    print(f"serve it with `pyllama-paged serve` (model name {stored.name!r}) or run it with "
          f"`pyllama-paged run --model {stored.path}`", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The console script's argument parser (every subcommand)."""
    parser = argparse.ArgumentParser(prog="pyllama-paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream a completion of PROMPT")
    _add_engine_args(run)
    run.add_argument("prompt", help="the text to continue")
    run.add_argument("--max-tokens", "-n", type=_max_tokens, default=128, metavar="N",
                     help="tokens to generate at most; -1: to the end of the context (default 128)")
    run.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 picks the likeliest token every time (default 0)")
    run.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens (default 40)")
    run.add_argument("--top-p", type=float, default=0.95,
                     help="sample among the likeliest tokens holding this much probability (default 0.95)")
    _add_generation_args(run)
    run.set_defaults(func=cmd_run)
    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_engine_args(chat)
    chat.add_argument("--max-tokens", "-n", type=_max_tokens, default=512, metavar="N",
                      help="tokens per answer at most; -1: to the end of the context (default 512)")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    _add_generation_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--hide-thinking", action="store_true",
                      help="leave a reasoning model's thinking out (shown dimmed by default)")
    chat.set_defaults(func=cmd_chat)
    srv = sub.add_parser("serve", help="Ollama- and OpenAI-compatible HTTP server")
    srv.add_argument("--model", "-m", action="append", default=None,
                     help="GGUF file to serve (repeatable; default: the embedded Gemma 3 270M)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=11434)
    srv.add_argument("--api-key", default=None, help="require this key (or set PYLLAMA_API_KEY)")
    _add_field_options(srv, _serve_options())
    srv.add_argument("--kv-budget", type=parse_kv_budget, default=None, help=_kv_budget_help())
    srv.add_argument("--itl-budget-ms", default="auto",
                     help="inter-token budget of running streams: new users are admitted (and prompts "
                          "prefilled) only as far as every stream keeps this gap; 'auto' = 4x a lone "
                          "stream's step on this machine, 'off' = throughput first")
    srv.add_argument("--origins", default=None,
                     help="browser origins allowed besides localhost, 127.0.0.1, app://, file://, tauri:// and "
                          "browser extensions: comma-separated, * as a wildcard (also PYLLAMA_PAGED_ORIGINS)")
    srv.add_argument("--drain-seconds", type=float, default=0.0,
                     help="on SIGTERM or Ctrl-C, answer /health with 503 for this long while still serving, "
                          "so that routers stop sending work, then stop (a second signal stops at once)")
    srv.add_argument("--kv-events", default=None, nargs="?", const="tcp://127.0.0.1:5557", metavar="ENDPOINT",
                     help="publish the prefix cache's stored and evicted blocks on this ZMQ PUB endpoint in "
                          "vLLM's KV-event format, for KV-aware routers (no value: tcp://127.0.0.1:5557; wildcards, "
                          "loopback and ipc:// bind, other hosts are connected to). As sensitive as the prompts: "
                          "docs/scale-out.md")
    srv.add_argument("--kv-events-bind", default=None, action=argparse.BooleanOptionalAction,
                     help="bind (--no-kv-events-bind: connect to) the --kv-events endpoint, whatever its address")
    srv.add_argument("--kv-events-token-ids", action="store_true",
                     help="put each stored block's token ids in the events (every prompt, verbatim: only on a "
                          "socket nobody else can reach); default: hashes only")
    srv.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                     help="ZMQ ROUTER endpoint where a subscriber asks for the batches it missed (bound)")
    srv.add_argument("--kv-events-topic", default="", help="ZMQ topic of the KV events (default none)")
    srv.add_argument("--kv-events-format", default="array", choices=["array", "map"],
                     help="events as tagged arrays (vLLM up to 0.23) or as maps (later vLLM)")
    srv.add_argument("--speculative", default=None, choices=["prompt_lookup", "draft_model"],
                     help="speculative decoding: prompt_lookup drafts from earlier text of the same "
                          "conversation, draft_model from a small model (--draft-model); a request opts "
                          "out with \"speculative\": false")
    srv.add_argument("--draft-model", default=None, metavar="PATH",
                     help="the GGUF that drafts for --speculative draft_model: a small model sharing "
                          "the served model's tokenizer (it implies --speculative draft_model)")
    srv.add_argument("--num-draft-tokens", type=int, default=4, help="most tokens drafted per step")
    srv.add_argument("--max-ngram", type=int, default=3, help="longest n-gram prompt lookup matches")
    srv.add_argument("--cache-ram", type=int, default=2048, metavar="MiB",
                     help="host RAM that keeps computed prompt blocks after the KV pool evicts them, per "
                          "model, restored instead of recomputed (llama-server's flag; 0: off)")
    srv.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                     help="also keep computed prompt blocks in this directory, across restarts and for "
                          "other servers sharing it (content-addressed, checksummed; off by default)")
    srv.add_argument("--prefix-cache-group", action="store_true",
                     help="share --prefix-cache-dir with the accounts of its group (a 2770 directory of a group of "
                          "exactly those accounts; docs/prefix-tiers.md) instead of keeping it private")
    srv.add_argument("--prefix-cache-disk", default="16GiB", metavar="SIZE",
                     help="most bytes of block files --prefix-cache-dir holds (oldest go first)")
    _add_pull_allow(srv)
    _add_limit_args(srv)
    _add_ray_args(srv)
    srv.set_defaults(func=cmd_serve)
    info = sub.add_parser("info", help="print a model's metadata and KV bytes per token")
    info.add_argument("path", nargs="?", default=None)
    _add_gpu_args(info)
    info.set_defaults(func=cmd_info)
    pull = sub.add_parser("pull", help="download a model into the local store (resuming an interrupted pull)",
                          description="REF: hf.co/USER/REPO[:QUANT] (a GGUF of a Hugging Face repository, "
                                      "Q4_K_M by default), USER/REPO with --file, or an Ollama registry name "
                                      "NAME[:TAG] / NAMESPACE/NAME:TAG. The store is $PYLLAMA_PAGED_MODELS "
                                      "(default ~/.cache/pyllama-paged/models); Hub files go to Hugging Face's "
                                      "cache (HF_HOME); PYLLAMA_PAGED_REGISTRY and HF_ENDPOINT pick the servers.")
    pull.add_argument("reference", metavar="REF")
    pull.add_argument("--file", default=None, metavar="GLOB",
                      help="the file of a Hugging Face USER/REPO to fetch (a glob such as '*Q4_K_M.gguf')")
    _add_pull_allow(pull)
    pull.set_defaults(func=cmd_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pyllama-paged` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (PagedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
