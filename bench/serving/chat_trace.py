"""Multi-user chat trace through the HTTP server, ours vs llama.cpp's
llama-server (what Ollama runs), side by side in one run, in the same KV bytes.

Trace (seeded, identical for both sides)
----------------------------------------
- --requests chat requests with Poisson arrivals at --rate per second (open
  loop: a request is sent at its arrival time whether or not earlier ones are
  done), each from its own client thread with the official `openai` client,
  streaming.
- Every request has one of --system-prompts shared system prompts (users of
  one app share it; the paged server's prefix cache can reuse it) and a user
  question. Output length is fixed per request (log-normal around
  --output-mean tokens, clipped to [16, 512]) and generated to the end
  (`ignore_eos`, which both servers accept), so both sides produce exactly
  the same number of tokens and the comparison is of speed alone.
- Sampling: --temperature (0.7) with each server's own defaults for the rest,
  as a chat client sends it; --greedy runs the same trace at temperature 0.

Sides
-----
- llama-server, once per --peers configuration: `npN` is `-np N -c --ctx`,
  `npN-kvu` adds its unified cache (`-kvu`: any slot may use any cell). The
  default pair is `np4` (Ollama's setup: 4 slots of 2,048 tokens) and
  `np16-kvu` (the best a llama.cpp user can pick in the same bytes). Its KV
  buffer bytes are read from its log; every configuration has the same -c,
  so the same bytes.
- --gpu-layers N puts that many layers on the GPU on both sides (`-ngl`; -1:
  all; llama-server with flash attention on), as bench/device_bench.py runs it
  on CUDA.
- ours: `pyllama-paged serve` in its own process, paged, with a KV pool of
  the same bytes (pool tokens = llama-server's KV bytes / our bytes per token;
  with a sliding-window model llama-server's bytes grow with its slots: ours
  gets the least of the configurations') and the first configuration's
  per-sequence context (--ctx / its N).

Ratios: ours against each configuration, and against the better of them
(its higher tokens/s, its lower TTFT p50 and inter-token p50, each taken
separately: the strictest reading).

Metrics per side: output tokens/s over the makespan (first request sent to last
token received), requests/min, time to first token and inter-token gap
percentiles (gaps between streamed content chunks, per request, pooled),
errors. Writes bench/results/chat_trace.{json,md,png}.

    bench/build_llama_cpp.sh      # once: llama.cpp's tools from the llama-cpp-python sdist
    python -m bench.serving.chat_trace
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.peers import (DEFAULT_KV_BYTES, add_server_arguments, llama_server_binary, our_bytes_per_token, parse_peer,
                          peer_chat_template, peer_label, start_llama_server, start_ours)
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_report
from pyllama_paged.testing.serving import stop_server

SYSTEM_PROMPTS = [
    "You are a helpful assistant for a hiking equipment store. Answer questions about boots, tents, "
    "backpacks and trail safety. Be friendly and concise, recommend products only when asked, and "
    "always remind customers to check the weather forecast before a long hike. If a question is not "
    "about hiking or outdoor gear, politely steer the conversation back to the store's products.",
    "You are a patient tutor who explains science to high-school students. Use simple words, give one "
    "concrete everyday example for every idea, and end each answer with a short question that checks "
    "understanding. Never give the answer to a homework problem directly; guide the student instead.",
    "You are a support agent for a small bank's mobile app. Help users with logging in, transfers, card "
    "settings and notifications. Never ask for passwords or full card numbers. When a problem needs a "
    "human, tell the user how to reach the support line and what information to have ready.",
]
QUESTIONS = [
    "What should I pack for a two-day hike in the mountains?", "Why is the sky blue?",
    "How do I reset my password if I forgot my email?", "Explain photosynthesis step by step.",
    "Which tent is best for rainy weather?", "What is the difference between speed and velocity?",
    "My transfer has been pending for two days, what can I do?", "How do vaccines train the immune system?",
    "Can you compare leather and synthetic hiking boots?", "Why do we have seasons on Earth?",
    "How do I turn off notifications for small purchases?", "What makes a chemical reaction go faster?",
]


def make_trace(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(1.0 / args.rate, size=args.requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    sigma = 0.5
    lengths = rng.lognormal(np.log(args.output_mean) - sigma ** 2 / 2, sigma, size=args.requests)
    lengths = np.clip(lengths, 16, 512).astype(int)
    return [{"arrival": float(arrivals[i]), "max_tokens": int(lengths[i]),
             "system": SYSTEM_PROMPTS[int(rng.integers(len(SYSTEM_PROMPTS)))],
             "question": QUESTIONS[int(rng.integers(len(QUESTIONS)))]} for i in range(args.requests)]


def one_request(client, model: str, item: dict, temperature: float, t0: float, out: dict) -> None:
    """Wait for the arrival time, stream one chat completion, record its timings."""
    delay = t0 + item["arrival"] - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    sent = time.perf_counter()
    stamps, tokens = [], None
    try:
        stream = client.chat.completions.create(
            model=model, stream=True, max_tokens=item["max_tokens"], temperature=temperature,
            messages=[{"role": "system", "content": item["system"]}, {"role": "user", "content": item["question"]}],
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 -- every failure is a counted error, the trace goes on
        out.update(error=f"{type(exc).__name__}: {exc}"[:300])
        return
    if not stamps:
        out.update(error="no tokens streamed")
        return
    out.update(sent=sent - t0, ttft=stamps[0] - sent, done=stamps[-1] - t0, itl=list(np.diff(stamps)),
               tokens=tokens if tokens is not None else len(stamps), chunks=len(stamps))


def run_trace(url: str, model: str, trace: list[dict], temperature: float) -> dict:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1800, max_retries=0)
    results = [{} for _ in trace]
    t0 = time.perf_counter() + 0.5
    threads = [threading.Thread(target=one_request, args=(client, model, item, temperature, t0, out))
               for item, out in zip(trace, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if "error" not in r]
    makespan = max(r["done"] for r in ok) if ok else float("nan")
    itl = [g for r in ok for g in r["itl"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    ttft = [r["ttft"] for r in ok]
    return {"requests": len(trace), "errors": len(trace) - len(ok),
            "error_samples": sorted({r["error"] for r in results if "error" in r})[:5],
            "output_tokens": sum(r["tokens"] for r in ok), "makespan_s": makespan,
            "tokens_per_s": sum(r["tokens"] for r in ok) / makespan, "requests_per_min": len(ok) / makespan * 60,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95), "itl_p50": pct(itl, 50),
            "itl_p95": pct(itl, 95), "itl_p99": pct(itl, 99), "per_request": results}


def plot(path: Path, runs: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label, res in runs.items():
        ok = [r for r in res["per_request"] if "error" not in r]
        by_end = sorted(ok, key=lambda r: r["done"])
        axes[0].plot([r["done"] for r in by_end], np.cumsum([r["tokens"] for r in by_end]), label=label)
        axes[1].plot(np.sort([r["ttft"] for r in ok]), np.linspace(0, 1, len(ok)), label=label)
        gaps = np.sort([g for r in ok for g in r["itl"]])
        axes[2].plot(gaps, np.linspace(0, 1, len(gaps)), label=label)
    axes[0].set(xlabel="time since the first request (s)", ylabel="output tokens completed", title="throughput")
    axes[1].set(xlabel="time to first token (s)", ylabel="fraction of requests", xscale="log", title="TTFT CDF")
    axes[2].set(xlabel="inter-token gap (s)", ylabel="fraction of gaps", xscale="log", title="inter-token CDF")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--output-mean", type=float, default=160, help="mean output tokens (log-normal)")
    ap.add_argument("--greedy", action="store_true", help="also run the trace at temperature 0")
    add_options(ap, rate=1.0, temperature=0.7, seed=0)
    add_server_arguments(ap)
    add_options(ap, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    from pyllama_paged.engine import default_model_path
    model_path = args.model or default_model_path()
    binary = llama_server_binary(args)
    trace = make_trace(args)
    temps = [args.temperature] + ([0.0] if args.greedy else [])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from pyllama_paged.tokenizer.vocab import read_tokenizer_metadata
    template = peer_chat_template(dict(read_tokenizer_metadata(model_path)), out_dir)
    kv_bytes = None
    peer_kv_bytes: dict[str, int] = {}
    runs: dict[str, dict] = {}
    peers = [parse_peer(p) for p in args.peers.split(",")] if "llama-server" in args.sides.split(",") else []
    seq_ctx = args.ctx // (peers[0][0] if peers else 4)
    # llama-server first: its KV bytes set our pool
    sides = [("llama-server", n, kvu) for n, kvu in peers] + [("ours", None, None)] * ("ours" in args.sides.split(","))
    for side, n_parallel, kvu in sides:
        name = peer_label(n_parallel, kvu) if side == "llama-server" else "ours"
        log = out_dir / f"chat_trace.{name.replace(' ', '_')}.server.log"
        if side == "llama-server":
            # on a GPU llama-server runs at its best with flash attention (the KV bytes do not change)
            flash = ["-fa", "on"] if args.gpu_layers else []
            proc, url, model, peer_bytes = start_llama_server(binary, model_path, args, n_parallel, kvu, log,
                                                              [*template, *flash])
            peer_kv_bytes[name] = peer_bytes
            # llama-server sizes a sliding-window cache by its slots: ours gets the least of them
            kv_bytes = min(peer_kv_bytes.values())
        else:
            per_token = our_bytes_per_token(args.model)
            budget = kv_bytes if kv_bytes else DEFAULT_KV_BYTES
            kv_tokens = budget // per_token
            proc, url, model = start_ours(args.model, kv_tokens, args, seq_ctx, log)
        try:
            for temp in temps:
                label = f"{name} t={temp:g}"
                print(f"running {label} ...", flush=True)
                res = run_trace(url, model, trace, temp)
                res.update(side=name, temperature=temp)
                if side == "llama-server":
                    res.update(kv_bytes=peer_kv_bytes[name])
                if side == "ours":
                    import httpx
                    stats = httpx.get(url + "/api/pool", timeout=30).json().get("stats", {})
                    res.update(kv_pool_tokens=kv_tokens, kv_bytes_per_token=per_token, engine_stats=stats)
                runs[label] = res
                print({k: v for k, v in res.items() if k != "per_request"}, flush=True)
        finally:
            stop_server(proc)

    rows = []
    for label, r in runs.items():
        rows.append({"side": r["side"], "temperature": r["temperature"], "requests": r["requests"],
                     "errors": r["errors"], "output tokens": r["output_tokens"],
                     "tokens/s": r["tokens_per_s"], "requests/min": r["requests_per_min"],
                     "TTFT p50 s": r["ttft_p50"], "TTFT p95 s": r["ttft_p95"],
                     "ITL p50 s": r["itl_p50"], "ITL p95 s": r["itl_p95"]})
    ratios = []
    for temp in temps:
        ours = runs.get(f"ours t={temp:g}")
        theirs = {peer_label(n, kvu): runs.get(f"{peer_label(n, kvu)} t={temp:g}") for n, kvu in peers}
        theirs = {k: v for k, v in theirs.items() if v}
        if not ours or not theirs:
            continue
        best = {"tokens_per_s": max(r["tokens_per_s"] for r in theirs.values()),
                "ttft_p50": min(r["ttft_p50"] for r in theirs.values()),
                "itl_p50": min(r["itl_p50"] for r in theirs.values())}
        for against, peer in [*theirs.items(), ("the better of them", best)]:
            ratio = {"temperature": temp, "against": against,
                     "tokens/s (target >= 1.5x)": ours["tokens_per_s"] / peer["tokens_per_s"],
                     "TTFT p50 (target <= 0.5x)": ours["ttft_p50"] / peer["ttft_p50"],
                     "ITL p50 (target <= 1.2x)": ours["itl_p50"] / peer["itl_p50"]}
            ratio["targets met"] = (ratio["tokens/s (target >= 1.5x)"] >= 1.5 and
                                    ratio["TTFT p50 (target <= 0.5x)"] <= 0.5 and
                                    ratio["ITL p50 (target <= 1.2x)"] <= 1.2)
            ratios.append(ratio)
    notes = (f"{args.requests} streaming chat requests (the `openai` client), Poisson arrivals at {args.rate}/s, "
             f"{len(SYSTEM_PROMPTS)} shared system prompts, fixed output lengths (mean {args.output_mean}, "
             f"`ignore_eos`), {args.threads} threads per server, {args.gpu_layers} GPU layers (-1: all). "
             f"llama-server: {', '.join(peer_label(n, kvu) for n, kvu in peers) or 'not run'}, each -c {args.ctx}, "
             + (", ".join(f"{k}: KV {v / 2**20:.1f} MiB" for k, v in peer_kv_bytes.items()) + " (from its log)"
                if peer_kv_bytes else "84 MiB assumed") + f"; ours: paged, the least of those bytes "
             f"({runs and next(iter(r.get('kv_pool_tokens') for r in runs.values() if 'kv_pool_tokens' in r), None)} "
             f"tokens of pool), context {seq_ctx} per sequence, block {args.block_size}.\n\n"
             "Ours / llama-server:\n\n" + (markdown_table(ratios) if ratios else "(one side only)\n"))
    return write_report("chat_trace", args, {"kv_bytes": kv_bytes, "peer_kv_bytes": peer_kv_bytes, "ratios": ratios,
                                             "runs": runs}, rows, out_dir=out_dir, notes=notes,
                        title="Chat trace through the HTTP server: ours vs llama-server, same KV bytes",
                        plot=lambda path: plot(path, runs))


if __name__ == "__main__":
    sys.exit(main())
