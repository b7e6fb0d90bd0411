"""Command line: `pyllama-paged run|chat|serve|info|pull`."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import sys
import time
from dataclasses import dataclass

from .calls.sampling_options import BASE_MODEL_MAX_TOKENS
from .errors import PagedError
from .flags import add_flags, flagged, read_flags


def _require_gpu(config) -> None:
    """--gpu-layers on a machine whose GGML lists no GPU is an error here (Llama only warns)."""
    if config.n_gpu_layers:
        from .engine import gpu_device

        gpu_device(config.main_gpu)


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


@dataclass
class _Answers:
    """What run and chat ask of every answer besides its length and temperature."""

    seed: int | None = flagged(None, "--seed", "sampling seed, for answers that repeat (default: a new one each "
                               "run)", type=int, show=lambda v: None)
    ignore_eos: bool = flagged(False, "--ignore-eos", "keep generating past the end-of-text token, up to "
                               "--max-tokens", action="store_true")


@dataclass
class RunSettings(_Answers):
    """`run`'s own options: how the completion of PROMPT is sampled."""

    max_tokens: int = flagged(BASE_MODEL_MAX_TOKENS, "--max-tokens", "tokens to generate at most; -1: to the end "
                              "of the context", type=_max_tokens, aliases=("-n",), metavar="N")
    temperature: float = flagged(0.0, "--temperature", "sampling temperature; 0 picks the likeliest token every "
                                 "time", type=float)
    top_k: int = flagged(40, "--top-k", "sample among the k likeliest tokens", type=int)
    top_p: float = flagged(0.95, "--top-p", "sample among the likeliest tokens holding this much probability",
                           type=float)
    image: str | None = flagged(None, "--image", "an image file PROMPT is about, as a chat turn (needs --mmproj)",
                                metavar="FILE")


@dataclass
class ChatSettings(_Answers):
    """`chat`'s own options: each answer's sampling, the system prompt, the thinking shown."""

    max_tokens: int = flagged(512, "--max-tokens", "tokens per answer at most; -1: to the end of the context",
                              type=_max_tokens, aliases=("-n",), metavar="N")
    temperature: float = flagged(0.7, "--temperature", "sampling temperature", type=float)
    system: str | None = flagged(None, "--system", "system prompt")
    hide_thinking: bool = flagged(False, "--hide-thinking", "leave a reasoning model's thinking out (shown dimmed "
                                  "by default)", action="store_true")


# the engine options of run and chat: EngineConfig's own flagged fields (serve has its groups too),
# each also the Llama argument of the same name
_LLAMA_SKIPS = ("scheduler", "speculative", "prefix_tiers")


def _model_path(name: str | None) -> str | None:
    """--model as a file, the GGUF of a pulled model's name or of an embedded model's
    (gemma3:270m-base, smollm2:135m); a clear error otherwise."""
    import os

    from .models.embedded import CHAT_MODEL_NAME, chat_model_missing, embedded_path

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
    embedded = embedded_path(name)
    if embedded is not None:
        return embedded
    if name.lower().removesuffix(":latest") == CHAT_MODEL_NAME:
        raise PagedError(f"--model {name}: {chat_model_missing()}")
    raise PagedError(f"--model {name}: no such file, and no pulled model of that name "
                     "(`pyllama-paged pull NAME` fetches one)")


def _open_llama(args, default_path=None):
    """The Llama that run and chat use, from the engine flags (each a Llama argument of its
    name); default_path(): the model without --model (None: the embedded base model)."""
    from .api.llama import Llama
    from .engine import EngineConfig

    _require_gpu(args)
    if args.n_ctx < args.block_size:
        raise PagedError(f"--ctx {args.n_ctx} is smaller than one KV page (--block-size {args.block_size}): "
                         f"give --ctx {args.block_size} or more")
    names = [f.name for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata and f.name != "model_path"]
    path = _model_path(args.model_path) if args.model_path is not None or default_path is None else default_path()
    return Llama(path, **{name: getattr(args, name) for name in names})


def _limit(max_tokens: int) -> int | None:
    """-n as the API's max_tokens (None: to the end of the context)."""
    return None if max_tokens == -1 else max_tokens


def _run_chunks(llm, args):
    """run's stream: PROMPT completed, or with --image a user turn of the image and PROMPT; the
    text of each chunk and the chunk."""
    sampling = dict(max_tokens=_limit(args.max_tokens), temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stream=True, ignore_eos=args.ignore_eos)
    if args.image is None:
        for chunk in llm.create_completion(args.prompt, **sampling):
            yield chunk["choices"][0]["text"], chunk
        return
    if not args.mmproj:
        raise PagedError("--image needs a vision projector: give --mmproj FILE")
    try:
        with open(args.image, "rb") as f:
            url = "data:image;base64," + base64.b64encode(f.read()).decode()
    except OSError as e:
        raise PagedError(f"--image {args.image}: {e.strerror}") from None
    turn = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": args.prompt}]
    for chunk in llm.create_chat_completion([{"role": "user", "content": turn}], **sampling):
        yield chunk["choices"][0]["delta"].get("content") or "", chunk


def cmd_run(args) -> int:
    with _open_llama(args) as llm:
        start = time.perf_counter()
        n = 0
        for text, chunk in _run_chunks(llm, args):
            sys.stdout.write(text)
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


BASE_MODEL_NOTE = ("note: this model has no chat template: it is a base model, not tuned to follow instructions, "
                   "so it continues your text rather than answering it, and may repeat itself. Without --model, "
                   "chat uses the embedded chat model smollm2:135m.")


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


def _chat_model() -> str:
    """chat's model without --model: the embedded chat model, or an error saying how to install it."""
    from .models.embedded import chat_model_missing, chat_model_path

    path = chat_model_path()
    if path is None:
        raise PagedError(f"{chat_model_missing()}; or give --model FILE.gguf or a pulled model's name")
    return path


def cmd_chat(args) -> int:
    with _open_llama(args, _chat_model) as llm:
        if not llm.metadata.get("tokenizer.chat_template"):
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


def serve_defaults():
    """`serve`'s settings before its options: ServeConfig's, with the RAM tier of the prefix cache on."""
    from .server.config import SERVE_COMMAND_TIERS, ServeConfig, served_engine

    return ServeConfig(engine=served_engine(prefix_tiers=SERVE_COMMAND_TIERS))


_SERVE_SKIPS = ("engine.model_path",)   # serve's --model is ServeConfig.models (repeatable)


def serve_config(args):
    """The ServeConfig of `serve`'s options and environment (PYLLAMA_API_KEY and
    PYLLAMA_PAGED_ORIGINS beside --api-key and --origins); SystemExit saying what is wrong."""
    import os

    from .server.config import ORIGINS_ENV, origin_list

    try:
        config = read_flags(serve_defaults(), args, skip=_SERVE_SKIPS)
        env_key = os.environ.get("PYLLAMA_API_KEY")
        config = dataclasses.replace(config, api_key=config.api_key or ([env_key] if env_key else None),
                                     origins=origin_list(os.environ.get(ORIGINS_ENV)) + config.origins)
        config.api_keys()   # a key file that cannot be read is said now, not at the first request
        return config
    except PagedError as e:
        raise SystemExit(str(e)) from None


def _allow_pulls(hosts: str | None) -> None:
    """--pull-allow: the hosts added to what pulls may reach, for this process and its children
    (models.egress reads them from the environment at each pull)."""
    import os

    from .models.egress import PULL_ALLOW_ENV

    added = [h.strip() for h in (hosts or "").split(",") if h.strip()]
    if added:
        os.environ[PULL_ALLOW_ENV] = ",".join(filter(None, [os.environ.get(PULL_ALLOW_ENV, ""), *added]))


def cmd_serve(args) -> int:
    from .server.app import serve

    config = serve_config(args)
    _allow_pulls(config.pull_allow)
    if config.scale_out is not None:
        return serve_on_ray(config)
    serve(config)
    return 0


def serve_on_ray(config) -> int:
    """`serve --ray ADDRESS`: the server as replicas on a Ray cluster, through Ray Serve."""
    try:
        from .server.scale_out.ray_app import run_on_ray
    except ImportError as e:
        raise SystemExit(f"--ray needs Ray Serve: pip install 'pyllama-paged[ray]' ({e})") from None
    if config.kv_events is not None:
        raise SystemExit("--kv-events publishes one server's cache; with --ray each replica would need an "
                         "endpoint of its own (not supported yet)")
    engine, scale = config.engine, config.scale_out
    threads_given = not engine.adapt_threads
    cpus = scale.replica_cpus if scale.replica_cpus is not None else float(engine.n_threads if threads_given else 1)
    if not threads_given:   # a replica's threads are its reserved CPUs, not the driver machine's
        engine = dataclasses.replace(engine, n_threads=max(1, int(cpus)), adapt_threads=False)
    scale = dataclasses.replace(scale, replica_cpus=cpus, max_ongoing_requests=engine.scheduler.max_num_seqs)
    return run_on_ray(dataclasses.replace(config, engine=engine, scale_out=scale))


def cmd_info(args) -> int:
    from .engine import KV_TYPES, KVGroups, Model, dense_kv_bytes_per_token

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
        from .engine import state_bytes_per_sequence
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
    from .engine import list_devices

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

    _allow_pulls(args.pull_allow)
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
    """The console script's argument parser (every subcommand): each option of run, chat and
    serve a flagged field of the settings it sets (flags.py); pull's and the positional
    arguments written here."""
    from .engine import EngineConfig
    from .models.egress import PULL_ALLOW_HELP

    parser = argparse.ArgumentParser(prog="pyllama-paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream a completion of PROMPT")
    add_flags(run, EngineConfig(), skip=_LLAMA_SKIPS)
    run.add_argument("prompt", help="the text to continue")
    add_flags(run, RunSettings())
    run.set_defaults(func=cmd_run)
    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    add_flags(chat, EngineConfig(), skip=_LLAMA_SKIPS)
    add_flags(chat, ChatSettings())
    chat.set_defaults(func=cmd_chat)
    srv = sub.add_parser("serve", help="Ollama- and OpenAI-compatible HTTP server")
    add_flags(srv, serve_defaults(), skip=_SERVE_SKIPS)
    srv.set_defaults(func=cmd_serve)
    info = sub.add_parser("info", help="print a model's metadata and KV bytes per token")
    info.add_argument("path", nargs="?", default=None)
    add_flags(info, EngineConfig(), only=("n_gpu_layers", "main_gpu"))
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
    pull.add_argument("--pull-allow", default=None, metavar="HOST[:PORT],...", help=PULL_ALLOW_HELP)
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
