"""Scale out on Ray Serve: prefix-affinity routing vs round-robin over the same replicas.

Cluster
-------
A Ray cluster on this machine (pyllama_paged/testing/ray_cluster.py): a head and
--replicas - 1 worker nodes of --threads CPUs each, so each replica (one engine, --threads
threads, its own KV pool of --kv-budget tokens) gets a node of its own. Each policy runs
on a fresh deployment (`pyllama-paged serve --ray ... --ray-router POLICY`): cold caches
for both.

Trace (seeded, identical for every policy)
------------------------------------------
--system-prompts distinct system prompts of about --system-tokens tokens each (an app's
long instructions; they differ from their first words, as apps' do); --users users, each
of one app (user i uses prompt i mod S), arriving as a Poisson process at --rate users/s;
each sends --turns chat turns one after another with --think seconds between them, the
conversation growing each turn (the assistant turns in the history are fixed texts, so
every policy sends the same prompts). Answers stream with the `openai` client, --max-tokens
tokens each (`ignore_eos`), greedy.

Measured per policy
-------------------
From the replicas' engines (GET /ray/replicas, before and after): prompt tokens queried
against the prefix cache, tokens found there (hit rate), prefill tokens computed
(queried - hits); from the clients: TTFT p50/p90, output tokens/s over the makespan,
requests per replica (the x-pyllama-replica header). Writes
bench/results/scale_out/scale_out.{json,md,png}.

    pip install 'pyllama-paged[ray,bench]'
    python -m bench.serving.scale_out
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.peers import stream_chat
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_report
from pyllama_paged.server.scale_out.ray_routing import PIN_HEADER
from pyllama_paged.testing.ray_cluster import RayCluster, start_ray_server, stop_ray_server

import httpx

OUT_DIR = RESULTS_DIR / "scale_out"
APPS = ["Acme Travel", "Borealis Bank", "Cedar Health", "Delta Freight", "Ember Games", "Fjord Energy",
        "Granite Legal", "Helix Labs"]
WORDS = ("always never customer order refund policy account delivery invoice ticket manager weekend "
         "holiday schedule price discount member premium basic support email phone chat hours region "
         "product warranty return exchange damaged missing late early secure password identity verify "
         "confirm cancel change upgrade downgrade contract renewal notice period escalate record summary "
         "polite concise friendly formal apologise thank explain clarify repeat check confirm document").split()
QUESTIONS = ["Can you help me with my last order?", "What are your opening hours on holidays?",
             "How do I change the email on my account?", "Is there a discount for members?",
             "My delivery is late, what should I do?", "How do I cancel my contract?",
             "Can I return a damaged product?", "Who do I call about an invoice?"]


def system_prompts(n: int, tokens: int, rng: np.random.Generator) -> list[str]:
    """n distinct system prompts of about `tokens` tokens (a word of this list is ~1 token)."""
    prompts = []
    for i in range(n):
        app = APPS[i % len(APPS)] + (f" {i // len(APPS) + 1}" if i >= len(APPS) else "")
        words = " ".join(rng.choice(WORDS, size=max(0, tokens - 40)))
        prompts.append(f"You are the assistant of {app}. Follow these house rules when you answer: {words}. "
                       f"Always sign your answers as the {app} assistant.")
    return prompts


def make_trace(args) -> list[dict]:
    """Each user's app, arrival time and turns (each turn's full message list)."""
    rng = np.random.default_rng(args.seed)
    systems = system_prompts(args.system_prompts, args.system_tokens, rng)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / args.rate, size=args.users - 1))])
    users = []
    for u in range(args.users):
        history = [{"role": "system", "content": systems[u % len(systems)]}]
        turns = []
        for t in range(args.turns):
            history = history + [{"role": "user", "content": QUESTIONS[int(rng.integers(len(QUESTIONS)))]}]
            turns.append(history)
            history = history + [{"role": "assistant", "content": f"(answer {t + 1} to user {u})"}]
        users.append({"app": u % len(systems), "arrival": float(arrivals[u]), "turns": turns})
    return users


def replica_figures(url: str) -> dict[str, dict]:
    """Each replica's engine counters, by replica id."""
    found = httpx.get(url + "/ray/replicas", timeout=120).json()["replicas"]
    return {r["replica"]: next(iter(r["models"].values())) or {} for r in found}


def run_user(client, model: str, user: dict, args, t0: float, out: list) -> None:
    """One user's turns, one after another, each streamed and timed."""
    delay = t0 + user["arrival"] - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    for messages in user["turns"]:
        sent = time.perf_counter()
        record = {"app": user["app"], "sent": sent - t0}
        try:
            stream, first = stream_chat(client, model, messages, args.max_tokens, record)
            record.update(replica=stream.response.headers.get(PIN_HEADER), done=time.perf_counter() - t0,
                          ttft=(first or time.perf_counter()) - sent)
        except Exception as exc:  # noqa: BLE001 -- a failed request is counted, the trace goes on
            record["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(record)
        time.sleep(args.think)


def run_policy(cluster: RayCluster, policy: str, trace: list[dict], args, out_dir: Path) -> dict:
    """Deploy the replicas with this routing policy, run the trace, read the engines."""
    import openai

    log = out_dir / f"scale_out.{policy}.serve.log"
    proc, url = start_ray_server(cluster, [
        "--replicas", str(args.replicas), "--threads", str(args.threads), "--ctx", str(args.ctx),
        "--kv-budget", str(args.kv_budget), "--max-seqs", str(args.max_seqs), "--ray-router", policy,
        "--route-prefix-chars", str(args.prefix_chars)], log)
    try:
        model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        before = replica_figures(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1800, max_retries=0)
        records: list[dict] = []
        t0 = time.perf_counter() + 0.5
        threads = [threading.Thread(target=run_user, args=(client, model, u, args, t0, records)) for u in trace]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = replica_figures(url)
    finally:
        stop_ray_server(proc)
    return summarize(policy, records, before, after)


def summarize(policy: str, records: list[dict], before: dict, after: dict) -> dict:
    """The policy's figures: cache, prefill, latency, throughput, placement."""
    def delta(key: str) -> int:
        return sum(after[r].get(key, 0) - before.get(r, {}).get(key, 0) for r in after)

    ok = [r for r in records if "error" not in r]
    queried, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    makespan = max((r["done"] for r in ok), default=float("nan")) - min((r["sent"] for r in ok), default=0.0)
    tokens = sum(r.get("tokens", 0) for r in ok)
    ttft = [r["ttft"] for r in ok]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    placement: dict[str, dict[str, int]] = {}
    for r in ok:
        per_app = placement.setdefault(str(r["app"]), {})
        per_app[r["replica"]] = per_app.get(r["replica"], 0) + 1
    return {"policy": policy, "requests": len(records), "errors": len(records) - len(ok),
            "error_samples": sorted({r["error"] for r in records if "error" in r})[:5],
            "prompt_tokens_queried": queried, "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / queried if queried else None, "prefill_tokens_computed": queried - hits,
            "computed_tokens": delta("computed_tokens"), "output_tokens": tokens, "makespan_s": makespan,
            "tokens_per_s": tokens / makespan if makespan > 0 else None,
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90),
            "requests_per_replica": {rid: sum(1 for r in ok if r["replica"] == rid) for rid in after},
            "replicas_per_app": {app: len(where) for app, where in placement.items()},
            "per_request": records}


def plot(path: Path, runs: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(runs)
    axes[0].bar(names, [100 * (runs[n]["prefix_hit_rate"] or 0) for n in names])
    axes[0].set(ylabel="prefix-cache hit rate (% of prompt tokens)", title="cache hits")
    axes[1].bar(names, [runs[n]["prefill_tokens_computed"] for n in names])
    axes[1].set(ylabel="prompt tokens computed", title="prefill work")
    for n in names:
        ttft = np.sort([r["ttft"] for r in runs[n]["per_request"] if "error" not in r])
        axes[2].plot(ttft, np.linspace(0, 1, len(ttft)), label=n)
    axes[2].set(xlabel="time to first token (s)", ylabel="fraction of requests", title="TTFT CDF")
    axes[2].legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--replicas", type=int, default=2)
    add_options(ap, threads=1, helps={"threads": "threads (and Ray CPUs) per replica"})
    ap.add_argument("--policies", default="prefix,round_robin",
                    help="routing policies to compare (prefix, round_robin, pow2)")
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--think", type=float, default=1.0, help="seconds between a user's turns")
    ap.add_argument("--prefix-chars", type=int, default=1024, help="leading characters prefix routing hashes")
    add_options(ap, system_tokens=500, rate=0.5, max_tokens=32, ctx=2048, kv_budget=16384, max_seqs=16, seed=0,
                out=str(OUT_DIR), helps={"rate": "users arriving per second (Poisson)",
                                         "kv_budget": "KV pool tokens per replica"})
    args = ap.parse_args(argv)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = make_trace(args)
    runs: dict[str, dict] = {}
    with RayCluster(workers=args.replicas - 1, cpus=args.threads) as cluster:
        for policy in args.policies.split(","):
            print(f"running {policy} ...", flush=True)
            runs[policy] = run_policy(cluster, policy, trace, args, out_dir)
            print({k: v for k, v in runs[policy].items() if k != "per_request"}, flush=True)

    rows = [{"routing": n, "requests": r["requests"], "errors": r["errors"],
             "prefix hit rate": r["prefix_hit_rate"], "prompt tokens": r["prompt_tokens_queried"],
             "prefill computed": r["prefill_tokens_computed"], "TTFT p50 s": r["ttft_p50"],
             "TTFT p90 s": r["ttft_p90"], "tokens/s": r["tokens_per_s"]} for n, r in runs.items()]
    placement = [{"routing": n, **{f"app {a}": k for a, k in r["replicas_per_app"].items()}} for n, r in runs.items()]
    notes = (f"{args.users} users x {args.turns} turns over {args.system_prompts} system prompts of ~"
             f"{args.system_tokens} tokens, Poisson arrivals at {args.rate} users/s, {args.think} s between turns, "
             f"{args.max_tokens} output tokens per answer (greedy, `ignore_eos`), streamed with the `openai` "
             f"client through Serve's HTTP proxy. {args.replicas} replicas of the default model, each on a Ray "
             f"node of its own with {args.threads} thread(s), a {args.kv_budget}-token KV pool and context "
             f"{args.ctx}; prefix routing hashes the first {args.prefix_chars} characters. Hit rate and prefill "
             "from the replicas' engines (GET /ray/replicas), before and after.\n\n"
             "Replicas each app's requests landed on:\n\n" + markdown_table(placement))
    return write_report("scale_out", args, {"runs": runs}, rows, out_dir=out_dir, notes=notes,
                        title="Scale out on Ray Serve: prefix-affinity vs round-robin routing",
                        plot=lambda path: plot(path, runs))


if __name__ == "__main__":
    sys.exit(main())
