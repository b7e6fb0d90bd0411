"""NVIDIA's AIPerf (`aiperf profile`, a load generator nobody here wrote) against our server
and llama.cpp's llama-server on the same model, side by side, with the same synthetic workload.

Workload
--------
AIPerf's synthetic chat prompts (Shakespeare text cut to --isl tokens, no spread), streaming
on the OpenAI chat endpoint, --osl output tokens generated to the end (`ignore_eos`, which
both servers accept) at --temperature, a fixed --seed (the same prompts for every side).
Closed loop: AIPerf keeps --concurrency requests in flight, for each level of the sweep
(1,4,16 by default) max(--min-requests, --rounds x level) requests, after a warmup of one
request per slot. Token counts are the servers' own (`--use-server-token-count`); the
tokenizer AIPerf sizes prompts with is the model's, written from the GGUF (below), so
--isl is in the model's tokens (the table's ISL adds the chat template's).

Sides (as bench/serving/chat_trace.py starts them, and in the same KV bytes)
-------------------------------------------------------------------
- llama-server, once per --peers configuration: `np4` is `-np 4 -c 8192` (Ollama's setup),
  `np16-kvu` is `-np 16 -kvu -c 8192` (its unified cache: the best a llama.cpp user can pick
  in the same bytes).
- ours: `pyllama-paged serve`, paged, a KV pool of llama-server's KV bytes and the first
  configuration's per-sequence context.
- A GGUF without a chat template (the default model has none): llama-server is given the
  built-in one ours uses (`--chat-template-file`, Gemma's turns); its own fallback, ChatML,
  would send the model other prompts (15 more tokens each here). The ISL column shows both
  sides' counts.

AIPerf runs on the same machine as the server (its workers take CPU from it on both sides
alike). Writes bench/results/aiperf/aiperf.{json,md,png}; AIPerf's own artifacts (one
directory per side and level: profile_export_aiperf.json/.csv, per-request records, its
log), the servers' logs and the tokenizer go to --work-dir (bench/.aiperf-work, git-ignored).

Install (AIPerf pins pillow, orjson and others below what our venv has, so it gets a venv of
its own; it needs Python 3.11-3.13). This script installs nothing:

    python3 -m venv bench/.aiperf-venv && bench/.aiperf-venv/bin/pip install aiperf
    bench/build_llama_cpp.sh      # once: llama.cpp's tools from the llama-cpp-python sdist
    python -m bench.serving.aiperf_bench  # from our venv (pip install '.[bench]')

The tokenizer: AIPerf loads a Hugging Face tokenizer (by hub name or from a directory) and
cannot reach the hub here, and its built-in tiktoken one downloads its table. So the
model's SentencePiece vocabulary is written from the GGUF as a `tokenizer.json` (a BPE whose
merges follow the pieces' scores, byte fallback, the user-defined pieces matched first),
and checked against our tokenizer (which agrees with llama.cpp) through AIPerf's own
loader before any run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.common.options import add_options
from bench.common.peers import (DEFAULT_KV_BYTES, add_server_arguments, llama_server_binary, our_bytes_per_token,
                          parse_peer, peer_chat_template, peer_label, start_llama_server, start_ours)
from bench.common.report import BENCH_DIR, REPO_ROOT, RESULTS_DIR, markdown_table, save_figure, script_parser, write_report
from pyllama_paged.testing.serving import stop_server

INSTALL_HINT = "python3 -m venv bench/.aiperf-venv && bench/.aiperf-venv/bin/pip install aiperf"
# what the check of the written tokenizer encodes, on both sides
TOKENIZER_PROBES = ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
                    "  two  spaces,\ttabs\nand new lines\n\n\n", "ünïcödé 日本語 🦊 3.14159 x**2 != y",
                    "def f(x):\n    return [i * 2 for i in range(x)]  # doubled"]
# the AIPerf figures kept in our JSON for each run (its export has some 70)
KEPT_METRICS = ("request_throughput", "request_latency", "time_to_first_token", "inter_token_latency",
                "output_token_throughput", "output_token_throughput_per_user", "input_sequence_length",
                "output_sequence_length", "request_count", "completed_request_count", "request_error_rate",
                "total_output_tokens", "benchmark_duration", "effective_concurrency")


def shown_path(path: Path) -> str:
    """path relative to the repository when inside it (the report is read from there)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def find_aiperf(given: str | None) -> Path:
    """The aiperf command: --aiperf, else bench/.aiperf-venv's, else one on PATH."""
    for candidate in (given, BENCH_DIR / ".aiperf-venv" / "bin" / "aiperf", shutil.which("aiperf")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    sys.exit(f"aiperf not found; install it in a venv of its own: {INSTALL_HINT}")


def write_tokenizer(metadata: dict, out_dir: Path) -> Path:
    """A GGUF's SentencePiece vocabulary (its tokenizer metadata) as a Hugging Face tokenizer
    directory (made once)."""
    from pyllama_paged.tokenizer.vocab import TokenType, as_text, vocab_from_metadata

    if (out_dir / "tokenizer.json").exists():
        return out_dir
    vocab = vocab_from_metadata(metadata)
    if vocab.model != "llama":
        sys.exit(f"tokenizer '{vocab.model}': only SentencePiece ('llama') vocabularies are written")
    tokens = [as_text(t) for t in vocab.tokens]
    types = vocab.token_types
    # SentencePiece merges the pair whose joined piece scores highest: a BPE whose merge ranks
    # follow the joined pieces' scores does the same, merging only into normal pieces
    normal = sorted((i for i, t in enumerate(types) if t == TokenType.NORMAL), key=lambda i: (-vocab.scores[i], i))
    rank = {tokens[i]: r for r, i in enumerate(normal)}
    merges = sorted((r, rank[p[:k]], rank[p[k:]], p[:k], p[k:]) for p, r in rank.items()
                    for k in range(1, len(p)) if p[:k] in rank and p[k:] in rank)
    # control pieces (<start_of_turn>) are special; user-defined ones ("\n\n", tags) are cut
    # out of the text before merging, as llama.cpp does
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] != TokenType.USER_DEFINED}
             for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)]
    # llama.cpp's defaults for a SentencePiece vocabulary where the GGUF leaves them out: BOS, and
    # a space in front of the text
    add_bos = vocab.add_bos is not False and vocab.bos_id is not None
    bos = tokens[vocab.bos_id] if add_bos else None
    prefix = [{"SpecialToken": {"id": bos, "type_id": 0}}] if bos else []
    space = "\u2581"
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": space}]
    if vocab.add_space_prefix is not False:
        normalizers.insert(0, {"type": "Prepend", "prepend": space})
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers}, "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [*prefix, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [*prefix, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos: {"id": bos, "ids": [vocab.bos_id], "tokens": [bos]}} if bos else {}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": space}, "content": " "},
                                                     {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[vocab.unk_id] if vocab.unk_id is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in reversed(list(enumerate(tokens)))},   # a repeated piece: its first id
                  "merges": [[a, b] for *_, a, b in merges]}}
    named = lambda tid: tokens[tid] if tid is not None else None  # noqa: E731
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": named(vocab.bos_id),
              "eos_token": named(vocab.eos_id), "unk_token": named(vocab.unk_id), "pad_token": named(vocab.pad_id),
              "model_max_length": 1 << 20}
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    tmp.rename(out_dir)   # whole or absent: an interrupted run writes it again
    return out_dir


def check_tokenizer(aiperf: Path, tok_dir: Path, gguf_path: str) -> None:
    """Exit unless AIPerf's loader, given tok_dir, encodes the probes as our tokenizer does."""
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    python = aiperf.parent / "python"
    if not python.exists():
        print(f"note: no python beside {aiperf}: the written tokenizer was not checked", flush=True)
        return
    script = ("import json, sys\nfrom aiperf.common.tokenizer import Tokenizer\n"
              "t = Tokenizer.from_pretrained(sys.argv[1])\n"
              "print(json.dumps([t.encode(s, add_special_tokens=False) for s in json.loads(sys.argv[2])]))")
    out = subprocess.run([str(python), "-c", script, str(tok_dir), json.dumps(TOKENIZER_PROBES)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"AIPerf could not load the tokenizer in {tok_dir}:\n{out.stderr[-2000:]}")
    ours = Tokenizer.from_gguf(gguf_path)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    for text, ids in zip(TOKENIZER_PROBES, theirs):
        expected = ours.encode(text, add_special=False)
        if ids != expected:
            sys.exit(f"the written tokenizer disagrees with ours on {text!r}: {ids} vs {expected}")


def aiperf_command(aiperf: Path, url: str, model: str, tok_dir: Path, concurrency: int, args,
                   artifacts: Path) -> list[str]:
    """One `aiperf profile` run: the synthetic workload at one concurrency."""
    requests = max(args.min_requests, args.rounds * concurrency)
    extra = {"ignore_eos": True, "temperature": args.temperature}
    return [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tok_dir), "--isl", str(args.isl), "--isl-stddev", "0",
            "--osl", str(args.osl), "--osl-stddev", "0", "--extra-inputs", json.dumps(extra),
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", str(concurrency), "--random-seed", str(args.seed),
            "--use-server-token-count", "--request-timeout-seconds", str(args.request_timeout),
            "--artifact-dir", str(artifacts), "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]


def run_aiperf(cmd: list[str], artifacts: Path) -> dict:
    """Run AIPerf; its exported summary (profile_export_aiperf.json)."""
    artifacts.mkdir(parents=True, exist_ok=True)
    console = artifacts / "console.txt"
    with console.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    summary = artifacts / "profile_export_aiperf.json"
    if done.returncode != 0 or not summary.exists():
        tail = console.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited with {done.returncode} (see {console}):\n{tail}")
    return json.loads(summary.read_text())


def summarize(export: dict) -> dict:
    """The figures of one AIPerf run that the table and plot show, in seconds and tokens."""
    stat = lambda name, key: export.get(name, {}).get(key)  # noqa: E731
    seconds = lambda name, key: None if stat(name, key) is None else stat(name, key) / 1000  # noqa: E731
    errors = sum(e.get("count", 0) for e in export.get("error_summary") or [])
    return {"requests": int(stat("request_count", "avg") or 0), "errors": errors,
            "tokens_per_s": stat("output_token_throughput", "avg"), "requests_per_s": stat("request_throughput", "avg"),
            "ttft_p50": seconds("time_to_first_token", "p50"), "ttft_p99": seconds("time_to_first_token", "p99"),
            "itl_p50": seconds("inter_token_latency", "p50"), "itl_p99": seconds("inter_token_latency", "p99"),
            "latency_p50": seconds("request_latency", "p50"),
            "user_tokens_per_s_p50": stat("output_token_throughput_per_user", "p50"),
            "isl_avg": stat("input_sequence_length", "avg"), "osl_avg": stat("output_sequence_length", "avg"),
            "duration_s": stat("benchmark_duration", "avg")}


def plot(path: Path, runs: list[dict]) -> None:
    """Tokens/s, TTFT p50 and ITL p50 against concurrency, a line per side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = sorted((r for r in runs if r["side"] == side), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        for ax, key in zip(axes, ("tokens_per_s", "ttft_p50", "itl_p50")):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=side)
    for ax, (ylabel, title) in zip(axes, (("output tokens/s", "throughput"), ("seconds", "time to first token p50"),
                                          ("seconds", "inter-token latency p50"))):
        ax.set(xlabel="concurrent requests (AIPerf)", ylabel=ylabel, title=title, xscale="log")
        ax.set_xticks(sorted({r["concurrency"] for r in runs}), labels=[str(c) for c in sorted({r["concurrency"] for r in runs})])
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def ratio_rows(runs: list[dict], ours: str, peers: list[str]) -> list[dict]:
    """Ours over each llama-server configuration, level by level."""
    by = {(r["side"], r["concurrency"]): r for r in runs}
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        mine = by.get((ours, c))
        for peer in peers:
            theirs = by.get((peer, c))
            if not mine or not theirs:
                continue
            div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
            rows.append({"concurrency": c, "against": peer,
                         "tokens/s": div(mine["tokens_per_s"], theirs["tokens_per_s"]),
                         "TTFT p50": div(mine["ttft_p50"], theirs["ttft_p50"]),
                         "ITL p50": div(mine["itl_p50"], theirs["itl_p50"])})
    return rows


def main(argv=None) -> int:
    """Run the sweep on every side; write the JSON, the markdown table and the plot."""
    ap = script_parser(__doc__)
    ap.add_argument("--concurrency", default="1,4,16", help="the sweep: requests kept in flight")
    ap.add_argument("--rounds", type=int, default=4, help="requests per level: this many x the concurrency ...")
    ap.add_argument("--min-requests", type=int, default=16, help="... and at least this many")
    ap.add_argument("--isl", type=int, default=256, help="synthetic prompt tokens (AIPerf --isl)")
    ap.add_argument("--osl", type=int, default=128, help="output tokens, generated to the end (AIPerf --osl)")
    ap.add_argument("--request-timeout", type=int, default=1800, help="seconds; a request past it is an error")
    add_options(ap, temperature=0.7, seed=0, helps={"seed": "AIPerf's --random-seed: the same prompts on every side"})
    add_server_arguments(ap)
    ap.add_argument("--aiperf", default=None, help="the aiperf command (default: bench/.aiperf-venv's, else PATH's)")
    ap.add_argument("--work-dir", default=str(BENCH_DIR / ".aiperf-work"),
                    help="AIPerf's artifacts, the servers' logs, the written tokenizer")
    add_options(ap, out=str(RESULTS_DIR / "aiperf"))
    args = ap.parse_args(argv)

    from pyllama_paged.engine import default_model_path
    # our server is this interpreter's `pyllama-paged`, whether or not its venv is activated
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    levels = [int(c) for c in args.concurrency.split(",")]
    aiperf = find_aiperf(args.aiperf)
    version = subprocess.run([str(aiperf), "--version"], capture_output=True, text=True).stdout.strip()
    model_path = args.model or default_model_path()
    work, out_dir = Path(args.work_dir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    from pyllama_paged.tokenizer.vocab import read_tokenizer_metadata
    metadata = dict(read_tokenizer_metadata(model_path))
    tok_dir = write_tokenizer(metadata, work / f"tokenizer-{Path(model_path).stem}")
    template = peer_chat_template(metadata, work)
    check_tokenizer(aiperf, tok_dir, model_path)

    sides = args.sides.split(",")
    binary = llama_server_binary(args)
    peers = [parse_peer(p) for p in args.peers.split(",")] if "llama-server" in sides else []
    seq_ctx = args.ctx // (peers[0][0] if peers else 4)
    peer_kv_bytes: dict[str, int] = {}
    kv_tokens = per_token = None
    runs: list[dict] = []
    # llama-server first: its KV bytes set our pool
    for side, n_parallel, kvu in [("llama-server", n, kvu) for n, kvu in peers] + [("ours", None, None)] * ("ours" in sides):
        name = peer_label(n_parallel, kvu) if side == "llama-server" else "ours"
        slug = name.replace(" ", "_")
        log = work / f"{slug}.server.log"
        if side == "llama-server":
            proc, url, model, peer_kv_bytes[name] = start_llama_server(binary, model_path, args, n_parallel, kvu,
                                                                        log, template)
        else:
            per_token = our_bytes_per_token(args.model)
            # llama-server sizes a sliding-window cache by its slots: ours gets the least of them
            kv_tokens = (min(peer_kv_bytes.values()) if peer_kv_bytes else DEFAULT_KV_BYTES) // per_token
            proc, url, model = start_ours(args.model, kv_tokens, args, seq_ctx, log)
        try:
            for c in levels:
                artifacts = work / slug / f"c{c}"
                shutil.rmtree(artifacts, ignore_errors=True)   # AIPerf's files of an earlier run
                cmd = aiperf_command(aiperf, url, model, tok_dir, c, args, artifacts)
                print(f"{name}, concurrency {c} ...", flush=True)
                export = run_aiperf(cmd, artifacts)
                run = {"side": name, "concurrency": c, **summarize(export), "artifacts": shown_path(artifacts),
                       "aiperf_command": export.get("run_info", {}).get("cli_command"),
                       "error_summary": export.get("error_summary"),
                       "aiperf": {k: export[k] for k in KEPT_METRICS if k in export}}
                runs.append(run)
                print({k: v for k, v in run.items() if k not in ("aiperf", "error_summary", "aiperf_command")},
                      flush=True)
        finally:
            stop_server(proc)

    rows = [{"side": r["side"], "concurrency": r["concurrency"], "requests": r["requests"], "errors": r["errors"],
             "tokens/s": r["tokens_per_s"], "requests/s": r["requests_per_s"], "TTFT p50 s": r["ttft_p50"],
             "TTFT p99 s": r["ttft_p99"], "ITL p50 s": r["itl_p50"], "ITL p99 s": r["itl_p99"],
             "latency p50 s": r["latency_p50"], "ISL": r["isl_avg"], "OSL": r["osl_avg"]} for r in runs]
    ratios = ratio_rows(runs, "ours", [peer_label(n, kvu) for n, kvu in peers])
    # the same prompts give the same input tokens unless the servers' chat templates differ
    # averages over the requests that succeeded: a side that lost a request averages another subset
    # of the same prompts, so only more than a token's difference says the templates differ
    unequal = any(max(isl) - min(isl) > 1.0 for c in levels
                  if (isl := [r["isl_avg"] for r in runs if r["concurrency"] == c]))
    notes = (f"AIPerf {version} (`aiperf profile`), the OpenAI chat endpoint, streaming; synthetic prompts of "
             f"{args.isl} tokens (the table's ISL: as the server counts it, with the chat template), {args.osl} "
             f"output tokens each (`ignore_eos`), temperature {args.temperature}, seed {args.seed}; per level "
             f"max({args.min_requests}, {args.rounds} x concurrency) requests after one warmup request per slot. "
             f"{args.threads} threads per server, {args.gpu_layers} GPU layers (-1: all). "
             + (", ".join(f"`{k} -c {args.ctx}` (KV {v / 2**20:.1f} MiB)" for k, v in peer_kv_bytes.items())
                or "llama-server not run") + (", given our built-in chat template" if peer_kv_bytes and template else "")
             + f"; ours: paged, {kv_tokens} tokens of pool (the least of those bytes), context {seq_ctx} per "
             f"sequence, block {args.block_size}. AIPerf runs on the same machine. Its artifacts: {shown_path(work)}.\n\n"
             + ("**The sides' input tokens differ (ISL): their chat templates differ.**\n\n" if unequal else "")
             + "Ours / llama-server (tokens/s: higher is better; TTFT and ITL: lower is better):\n\n"
             + (markdown_table(ratios) if ratios else "(one side only)\n"))
    data = {"aiperf_version": version, "peer_kv_bytes": peer_kv_bytes, "peer_extra_args": template,
            "kv_pool_tokens": kv_tokens, "kv_bytes_per_token": per_token, "ratios": ratios, "runs": runs}
    return write_report("aiperf", args, data, rows, out_dir=out_dir, notes=notes, plot=lambda path: plot(path, runs),
                        title="AIPerf against our server and llama-server, same model, same KV bytes")


if __name__ == "__main__":
    sys.exit(main())
