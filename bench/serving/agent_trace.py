"""An agent trace with a restart: the prefix cache's RAM and disk tiers (issue 29) against
no tier and against llama-server's --cache-ram, the server stopped and started again
half-way through.

Trace (seeded, identical for every configuration)
-------------------------------------------------
--agents agents, each with a system prompt of about --system-tokens tokens (the model's
own tokenizer counts them): instructions, then a JSON list of tool definitions, generated
from word lists; each agent's prompt differs from its first words. --users-per-agent users
per agent each hold a conversation of --turns short turns: a user message of 20-40 tokens,
an answer of --max-tokens tokens (`ignore_eos`, greedy), the history growing. The
assistant turns in the history are fixed texts (a short generated reply, the same for every
configuration), not the answers, so every configuration sends exactly the same prompts.
Turns go round-robin over the users, whose order alternates the agents (turn 1 of every
user, then turn 2, ...), --concurrency requests in flight (a user's next turn waits for its
previous one). Three agents' prompts plus the histories do not fit the --kv-budget pool:
the pool evicts, and round-robin order makes it evict what comes next.

After turn --turns // 2 of every user (all answered) the server is stopped (SIGTERM, wait
for it to exit) and started again with the same flags (a new port), and the trace goes on.

Configurations (each a fresh server process, a fresh cache directory)
---------------------------------------------------------------------
- ours, no tier (`--cache-ram 0`), ours with the RAM tier (its default `--cache-ram`),
  ours with RAM and disk tiers (`--prefix-cache-dir`, a fresh temporary directory that
  both lives share): --tiers off,ram,disk. Pool: --kv-budget tokens, block --block-size.
- llama-server (--peers, default np3-kvu: `-np 3 -kvu -c --ctx`, --ctx 14336 by default:
  the same KV bytes as our default 4096-token pool, 72 MiB, since llama-server sizes its
  sliding-window layers by slot and only its 3 global layers by -c): one slot per agent, so its slot-prompt similarity can keep
  each agent's conversation in a slot of its own; -kvu because without it each of the three
  slots gets a third of the cells, fewer than one agent's prompt with its history; its own
  `--cache-ram` (--peer-cache-ram, its default 8192 MiB) keeps prompts that leave a slot.
  It gets our model's built-in chat template (common.peers.peer_chat_template).

Measured per configuration
--------------------------
Prefill tokens computed: ours, from /api/pool's stats (computed_tokens minus the decode
tokens) summed over both lives; llama-server, the sum of its `timings.prompt_n`. Also ours'
prompt tokens found in the pool's prefix cache and restored from the tiers (RAM and disk
blocks). TTFT p50/p90 over all turns; each agent's first turn after the restart against
its cold first turn (the trace's first request of that agent), their ratio (the issue's
target: <= 0.2x with the disk tier); output tokens/s over the two lives' makespans (the
restart's downtime, reported apart, excluded). Writes
bench/results/agent_trace/agent_trace.{json,md,png}.

    bench/build_llama_cpp.sh      # once: llama.cpp's llama-server
    python -m bench.serving.agent_trace
    python -m bench.serving.agent_trace --agents 2 --users-per-agent 1 --turns 3 --system-tokens 1000   # smoke
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common.options import add_options
from bench.common.peers import (add_server_arguments, llama_server_binary, parse_peer, peer_chat_template,
                                peer_label, start_llama_server, start_ours, stream_chat)
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_report
from pyllama_paged.testing.serving import stop_server

OUT_DIR = RESULTS_DIR / "agent_trace"
AGENTS = [("Atlas", "travel desk", "flights, hotels, rail passes and travel insurance"),
          ("Beacon", "IT helpdesk", "laptops, VPN access, password resets and software licences"),
          ("Cobalt", "finance assistant", "invoices, expense reports, budgets and vendor payments"),
          ("Dune", "logistics planner", "shipments, warehouses, customs papers and carrier quotes"),
          ("Ember", "recruiting coordinator", "job postings, interviews, offers and onboarding"),
          ("Fable", "content editor", "articles, style guides, image rights and publishing schedules")]
VERBS = ["search", "create", "update", "cancel", "list", "get", "validate", "estimate", "schedule", "approve",
         "export", "summarize", "compare", "assign", "notify", "archive"]
NOUNS = ["booking", "ticket", "invoice", "shipment", "candidate", "article", "report", "account", "quote",
         "calendar_event", "approval", "document", "payment", "policy", "inventory_item", "user"]
PARAMS = [("id", "string", "the record's identifier"), ("query", "string", "free text to search for"),
          ("start_date", "string", "ISO 8601 date the period starts"), ("end_date", "string", "ISO 8601 end date"),
          ("limit", "integer", "most results to return"), ("currency", "string", "three-letter currency code"),
          ("amount", "number", "amount in the given currency"), ("priority", "string", "low, normal or urgent"),
          ("owner_email", "string", "who is responsible"), ("notes", "string", "a short free-text comment"),
          ("dry_run", "boolean", "validate only, change nothing"), ("region", "string", "ISO country code")]
RULES = ["Always confirm the {noun} with the user before you call a tool that changes it.",
         "Never reveal internal identifiers of a {noun} unless the user quotes them first.",
         "When a request about a {noun} is ambiguous, ask exactly one clarifying question.",
         "Prefer {verb}_{noun} over guessing; report its result in one or two sentences.",
         "If {verb}_{noun} fails, explain the error in plain words and suggest the next step.",
         "Keep answers short: at most three sentences unless the user asks for detail about the {noun}.",
         "Quote amounts with their currency and dates in the user's time zone when you {verb} the {noun}.",
         "Do not {verb} more than one {noun} per turn without the user's explicit approval.",
         "Log every change to the {noun} with a one-line reason in the notes field.",
         "Escalate to a human when the user disputes a {noun} twice in the same conversation."]
ASKS = ["Can you {verb} the {noun} for the team offsite next month",
        "Please {verb} my {noun} from last Tuesday, the one for the Berlin office",
        "I need you to {verb} every {noun} that is still open for the northern region",
        "Could you {verb} the {noun} we discussed and tell me what changes",
        "What happens if I {verb} the {noun} before the end of the quarter",
        "Quickly {verb} the {noun} for Maria, she is waiting on it"]
TAILS = ["and keep the cost under the usual limit", "but only if nothing else depends on it",
         "then send me a short summary", "and use the same settings as last time", "by tomorrow morning please",
         "without notifying the whole team", "and double-check the dates", "if that is allowed by the policy"]
REPLIES = ["Done: I called {verb}_{noun}, it succeeded, and the {noun} now shows the change you asked for.",
           "I checked with {verb}_{noun}; nothing needs to change yet, but I noted your request for later.",
           "The {noun} needs your approval first. Shall I go ahead and {verb} it with the settings above?",
           "I could not {verb} the {noun}: it is locked by another user. I will retry in a few minutes."]


def pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def tool(rng: np.random.Generator) -> dict:
    """One tool definition, in the JSON-schema shape agents' tool lists use."""
    verb, noun = pick(rng, VERBS), pick(rng, NOUNS)
    params = [PARAMS[int(i)] for i in rng.choice(len(PARAMS), size=int(rng.integers(2, 6)), replace=False)]
    return {"type": "function", "function": {
        "name": f"{verb}_{noun}",
        "description": f"{verb.capitalize()} the {noun.replace('_', ' ')}. " + pick(rng, RULES).format(
            verb=verb, noun=noun.replace("_", " ")),
        "parameters": {"type": "object",
                       "properties": {p: {"type": t, "description": d} for p, t, d in params},
                       "required": [params[0][0]]}}}


def system_prompt(agent: int, tokens: int, count, rng: np.random.Generator) -> str:
    """Agent `agent`'s prompt: about a quarter instructions, the rest tools, ~`tokens` tokens."""
    name, role, scope = AGENTS[agent % len(AGENTS)]
    name += f" {agent // len(AGENTS) + 1}" if agent >= len(AGENTS) else ""
    head = (f"{name} is the {role} agent of Northwind Group. It helps employees with {scope}. "
            "It answers in the user's language and calls the tools below when they help.\n\nRules:\n")
    rules, used = [], count(head)
    while used < tokens // 4:
        rules.append("- " + pick(rng, RULES).format(verb=pick(rng, VERBS), noun=pick(rng, NOUNS).replace("_", " ")))
        used += count(rules[-1]) + 1
    tools = []
    while used < tokens - 20:
        tools.append(tool(rng))
        used += count(json.dumps(tools[-1])) + 1
    return head + "\n".join(rules) + "\n\nTools (JSON):\n" + json.dumps(tools, indent=None) + \
        f"\n\nSign every answer as {name}."


def user_message(rng: np.random.Generator, count) -> str:
    """A request of 20-40 tokens."""
    text = pick(rng, ASKS).format(verb=pick(rng, VERBS), noun=pick(rng, NOUNS).replace("_", " "))
    while count(text) < 20:
        text += ", " + pick(rng, TAILS)
    return text + "?"


def make_trace(args, count) -> tuple[list[str], list[dict]]:
    """The agents' system prompts, and every request in trace order (turn-major over the
    users, whose order alternates the agents), each with its full message list."""
    rng = np.random.default_rng(args.seed)
    systems = [system_prompt(a, args.system_tokens, count, rng) for a in range(args.agents)]
    users = args.agents * args.users_per_agent
    histories = [[{"role": "system", "content": systems[u % args.agents]}] for u in range(users)]
    items = []
    for t in range(args.turns):
        for u in range(users):
            h = histories[u] + [{"role": "user", "content": user_message(rng, count)}]
            items.append({"index": len(items), "user": u, "agent": u % args.agents, "turn": t,
                          "phase": 0 if t < args.turns // 2 else 1, "messages": h})
            reply = pick(rng, REPLIES).format(verb=pick(rng, VERBS), noun=pick(rng, NOUNS).replace("_", " "))
            histories[u] = h + [{"role": "assistant", "content": reply}]
    return systems, items


def stream_turn(client, model: str, item: dict, args, t0: float) -> dict:
    """One streamed chat turn: TTFT, tokens, and llama-server's prompt timings if it sends them."""
    record = {k: item[k] for k in ("index", "user", "agent", "turn", "phase")}
    sent = time.perf_counter()
    record["sent"] = sent - t0
    try:
        def timed(chunk) -> None:   # llama-server's prompt timings, when it sends them
            timings = (chunk.model_extra or {}).get("timings")
            if timings:
                record.update(prompt_n=timings.get("prompt_n"), cache_n=timings.get("cache_n"))

        _, first = stream_chat(client, model, item["messages"], args.max_tokens, record, timed)
        if first is None:
            raise RuntimeError("no tokens streamed")
        record.update(ttft=first - sent, done=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 -- a failed turn is counted, the trace goes on
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return record


def run_phase(url: str, model: str, items: list[dict], args, done: dict) -> list[dict]:
    """Run items in order, --concurrency at a time, each user's turn after its previous one
    (done: (user, turn) -> Event, set when that turn ends)."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1800, max_retries=0)
    records, lock, queue = [], threading.Lock(), list(items)
    t0 = time.perf_counter()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                item = queue.pop(0)
            before = done.get((item["user"], item["turn"] - 1))
            if before is not None:
                before.wait()
            record = stream_turn(client, model, item, args, t0)
            with lock:
                records.append(record)
            done[(item["user"], item["turn"])].set()

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: r["index"])


def terminate(proc: subprocess.Popen, timeout: float = 120) -> float:
    """SIGTERM and wait for the process to exit; after timeout a second signal (a server
    then stops at once), then a kill. The seconds it took."""
    start = time.perf_counter()
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop_server(proc)
    return time.perf_counter() - start


def mean(xs) -> float | None:
    """The mean of the values that are there (None: none are)."""
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def pool_stats(url: str) -> dict:
    return httpx.get(url + "/api/pool", timeout=60).json().get("stats", {})


STAT_KEYS = ("computed_tokens", "generated_tokens", "prefix_cache_queries", "prefix_cache_hits",
             "prefix_tier_hits", "tier_ram_hit_blocks", "tier_disk_hit_blocks", "tier_saved_blocks",
             "tier_miss_blocks", "preemptions")


def run_config(name: str, ours: bool, start, trace: list[dict], args) -> dict:
    """Both lives of one configuration: start, first half, SIGTERM, start, second half."""
    done = {(it["user"], it["turn"]): threading.Event() for it in trace}
    records, lives = [], []
    for phase in (0, 1):
        started = time.perf_counter()
        proc, url, model = start(phase)
        life = {"start_s": time.perf_counter() - started}
        try:
            before = pool_stats(url) if ours else {}
            t0 = time.perf_counter()
            recs = run_phase(url, model, [it for it in trace if it["phase"] == phase], args, done)
            life["makespan_s"] = time.perf_counter() - t0
            after = pool_stats(url) if ours else {}
            life.update(stats_after=after, delta={k: after.get(k, 0) - before.get(k, 0) for k in STAT_KEYS})
        finally:
            life["stop_s"] = terminate(proc)
            life["exit_code"] = proc.returncode
        lives.append(life)
        records += recs
        print(f"  {name} life {phase + 1}: {len(recs)} turns in {life['makespan_s']:.1f} s, "
              f"stats delta {life['delta'] if ours else '-'}", flush=True)
    return summarize(name, ours, records, lives, args)


def summarize(name: str, ours: bool, records: list[dict], lives: list[dict], args) -> dict:
    ok = [r for r in records if "error" not in r]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    tokens = sum(r.get("tokens", 0) for r in ok)
    total = {k: sum(life["delta"].get(k, 0) for life in lives) for k in STAT_KEYS}
    if not ours:
        prefill = sum(r.get("prompt_n") or 0 for r in ok) if all("prompt_n" in r for r in ok) else None
        hits = None
    else:   # every answer's last token is sampled but never run through the model
        prefill = total["computed_tokens"] - (total["generated_tokens"] - len(ok))
        hits = total["prefix_cache_hits"]
    first = {}
    for r in records:   # each agent's first turn in each life (the trace's order)
        first.setdefault((r["phase"], r["agent"]), r)
    cold = [first[(0, a)].get("ttft") for a in range(args.agents)]
    warm = [first[(1, a)].get("ttft") for a in range(args.agents)]
    ratios = [w / c if w is not None and c else None for c, w in zip(cold, warm)]
    makespan = sum(life["makespan_s"] for life in lives)
    return {"config": name, "requests": len(records), "errors": len(records) - len(ok),
            "error_samples": sorted({r["error"] for r in records if "error" in r})[:5],
            "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in ok), "prefill_tokens_computed": prefill,
            "pool_hit_tokens": hits, "stats_total": total, "output_tokens": tokens, "makespan_s": makespan,
            "tokens_per_s": tokens / makespan if makespan > 0 else None,
            "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p90": pct([r["ttft"] for r in ok], 90),
            "cold_first_ttft": cold, "restart_first_ttft": warm, "restart_ratio": ratios,
            "restart_ratio_mean": mean(ratios) if None not in ratios else None,
            "restart_s": lives[0]["stop_s"] + lives[1]["start_s"], "lives": lives, "per_request": records}


def plot(path: Path, runs: dict, restart_at: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(runs)
    for n in names:
        ok = [r for r in runs[n]["per_request"] if "error" not in r]
        axes[0].plot([r["index"] for r in ok], [r["ttft"] for r in ok], ".-", label=n, lw=0.8)
    axes[0].axvline(restart_at - 0.5, color="k", ls="--", lw=0.8)
    axes[0].set(xlabel="turn (trace order; dashed: restart)", ylabel="TTFT (s)", yscale="log", title="TTFT per turn")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [runs[n]["prefill_tokens_computed"] or 0 for n in names])
    axes[1].set(ylabel="prompt tokens computed", title="prefill work (both lives)")
    x = np.arange(len(names))
    axes[2].bar(x - 0.2, [mean(runs[n]["cold_first_ttft"]) or 0 for n in names], 0.4, label="cold first turn")
    axes[2].bar(x + 0.2, [mean(runs[n]["restart_first_ttft"]) or 0 for n in names], 0.4,
                label="first turn after restart")
    axes[2].set_xticks(x, names)
    axes[2].set(ylabel="TTFT, mean over agents (s)", title="restart vs cold start")
    axes[2].legend(fontsize=8)
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--users-per-agent", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6, help="turns per user; the restart comes after half of them")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    ap.add_argument("--seq-ctx", type=int, default=8192, help="our per-sequence context")
    ap.add_argument("--tiers", default="off,ram,disk", help="our configurations: off, ram, disk")
    ap.add_argument("--cache-ram", type=int, default=2048, help="our RAM tier (MiB) in ram and disk")
    ap.add_argument("--peer-cache-ram", type=int, default=8192, help="llama-server's --cache-ram (MiB)")
    add_options(ap, system_tokens=4096, max_tokens=24, kv_budget=4096, seed=0, out=str(OUT_DIR),
                helps={"system_tokens": "tokens of each agent's system prompt",
                       "kv_budget": "our KV pool, in tokens of every layer (4096: 72 MiB for the default model)"})
    add_server_arguments(ap)
    # llama-server's -c 14336 with -np 3 -kvu takes the same 72 MiB as our 4096-token pool: it
    # sizes its 15 sliding-window layers by slot (3 x 512 + a batch), its 3 global ones by -c
    ap.set_defaults(ctx=14336, peers="np3-kvu", max_seqs=16)
    args = ap.parse_args(argv)
    if args.turns < 2:
        ap.error("--turns must be >= 2 (the restart comes after half of them)")

    from pyllama_paged.engine import default_model_path
    from pyllama_paged.tokenizer.tokenizer import Tokenizer
    from pyllama_paged.tokenizer.vocab import read_tokenizer_metadata
    model_path = args.model or default_model_path()
    tokenizer = Tokenizer.from_gguf(model_path)
    count = lambda text: len(tokenizer.encode(text, add_special=False))  # noqa: E731
    systems, trace = make_trace(args, count)
    restart_at = next(it["index"] for it in trace if it["phase"] == 1)
    system_tokens = [count(s) for s in systems]
    print(f"{len(trace)} turns, system prompts of {system_tokens} tokens, restart before turn {restart_at}",
          flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sides = args.sides.split(",")
    binary = llama_server_binary(args)
    template = peer_chat_template(dict(read_tokenizer_metadata(model_path)), out_dir)

    configs = []   # (name, [extra flags] or peer spec)
    if "ours" in sides:
        configs += [(f"ours, {t}", t) for t in args.tiers.split(",")]
    if "llama-server" in sides:
        configs += [(peer_label(*parse_peer(p)), parse_peer(p)) for p in args.peers.split(",")]
    runs: dict[str, dict] = {}
    kv_bytes: dict[str, int] = {}
    our_block = [None]   # the block size our server chose (it may round --block-size up)
    for name, spec in configs:
        print(f"running {name} ...", flush=True)
        slug = name.replace(", ", "-").replace(" ", "_")
        disk = tempfile.mkdtemp(prefix="agent_trace_disk_") if spec == "disk" else None
        if isinstance(spec, tuple):
            def start(phase, spec=spec, slug=slug, name=name):
                proc, url, model, peer_bytes = start_llama_server(
                    binary, model_path, args, *spec, out_dir / f"agent_trace.{slug}.life{phase + 1}.log",
                    template + ["--cache-ram", str(args.peer_cache_ram)])
                kv_bytes[name] = peer_bytes
                return proc, url, model
        else:
            extra = {"off": ["--cache-ram", "0"], "ram": ["--cache-ram", str(args.cache_ram)],
                     "disk": ["--cache-ram", str(args.cache_ram), "--prefix-cache-dir", str(disk)]}[spec]

            def start(phase, extra=extra, slug=slug, name=name):
                proc, url, model = start_ours(args.model, args.kv_budget, args, args.seq_ctx,
                                              out_dir / f"agent_trace.{slug}.life{phase + 1}.log", extra)
                stats = pool_stats(url)
                kv_bytes[name] = stats.get("kv_pool_bytes")
                our_block[0] = stats.get("block_size")
                return proc, url, model
        try:
            runs[name] = run_config(name, not isinstance(spec, tuple), start, trace, args)
        finally:
            if disk:
                shutil.rmtree(disk, ignore_errors=True)
        print({k: v for k, v in runs[name].items() if k not in ("per_request", "lives")}, flush=True)

    rows = []
    for n, r in runs.items():
        s = r["stats_total"]
        ours = n.startswith("ours")
        rows.append({"configuration": n, "errors": r["errors"], "prefill computed": r["prefill_tokens_computed"],
                     "pool hits": r["pool_hit_tokens"], "tier hits": s["prefix_tier_hits"] if ours else None,
                     "RAM / disk blocks": f"{s['tier_ram_hit_blocks']} / {s['tier_disk_hit_blocks']}" if ours else "-",
                     "TTFT p50 s": r["ttft_p50"], "TTFT p90 s": r["ttft_p90"],
                     "cold 1st TTFT s": mean(r["cold_first_ttft"]),
                     "after-restart 1st TTFT s": mean(r["restart_first_ttft"]),
                     "restart / cold": r["restart_ratio_mean"],
                     "<= 0.2x": r["restart_ratio_mean"] is not None and r["restart_ratio_mean"] <= 0.2,
                     "tokens/s": r["tokens_per_s"], "restart s": r["restart_s"]})
    per_agent = [{"configuration": n, **{f"agent {a}": f"{c:.2f} -> {w:.2f} s ({w / c:.2f}x)"
                                         for a, (c, w) in enumerate(zip(r["cold_first_ttft"], r["restart_first_ttft"]))
                                         if c and w}} for n, r in runs.items()]
    users = args.agents * args.users_per_agent
    notes = (f"{args.agents} agents with system prompts of {', '.join(map(str, system_tokens))} tokens "
             f"(instructions + JSON tool list), {args.users_per_agent} users each, {args.turns} turns per user "
             f"({len(trace)} in all, round-robin over the {users} users), user messages of 20-40 tokens, fixed "
             f"assistant texts in the history, {args.max_tokens} output tokens per answer (greedy, `ignore_eos`), "
             f"{args.concurrency} requests in flight, streamed with the `openai` client; the server stopped "
             f"(SIGTERM) and started again before turn {restart_at} (after turn {args.turns // 2} of every user). "
             f"{args.threads} threads per server. Ours: --kv-budget {args.kv_budget} tokens, context "
             f"{args.seq_ctx}, block {our_block[0]}, RAM tier {args.cache_ram} MiB in `ram` and `disk`. "
             f"llama-server: -c {args.ctx}, its --cache-ram {args.peer_cache_ram} MiB. KV bytes: "
             + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in kv_bytes.items() if v) + ". "
             "Prefill computed: ours from /api/pool (computed minus decode tokens, both lives), llama-server "
             "the sum of `timings.prompt_n`. Pool hits / tier hits: prompt tokens found in the pool's prefix "
             "cache / restored from the RAM or disk tier. Restart / cold: each agent's first turn after the "
             "restart over its first turn in the trace, mean over agents (target <= 0.2x with the disk tier); "
             "tokens/s over both lives' makespans, the restart (restart s: stop + start until healthy) "
             "excluded.\n\nEach agent's first-turn TTFT, cold -> after the restart:\n\n" + markdown_table(per_agent))
    return write_report("agent_trace", args, {"system_prompt_tokens": system_tokens, "restart_before_turn": restart_at,
                                              "kv_bytes": kv_bytes, "our_block_size": our_block[0], "runs": runs},
                        rows, out_dir=out_dir, title="Agent trace with a restart: prefix-cache tiers vs llama-server",
                        notes=notes, plot=lambda path: plot(path, runs, restart_at))


if __name__ == "__main__":
    sys.exit(main())
