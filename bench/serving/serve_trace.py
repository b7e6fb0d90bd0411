"""Serving experiment on the real engine: one seeded request trace through
paged=True and paged=False with the same KV memory budget, side by side in one
run (the seeds' "stand up two servers on the same hardware" experiment, here
on the default Gemma 3 270M model on CPU).

Trace (seeded, identical for both sides)
----------------------------------------
- --num-requests client requests; Poisson arrivals at --rate requests per
  *second of wall time* (the first at t=0). Both sides replay the same
  arrival times from the start of their own run, so a side that serves slower
  builds a longer queue.
- prompt length ~ log-normal with mean --prompt-mean (sigma --sigma), clipped
  to [16, min(512, n_ctx/2)]; output length (max_tokens) ~ log-normal with
  mean --output-mean, clipped to [4, 256] (and to the context). Generation
  stops early at an end-of-turn token, as a server would.
- --frac-shared of the requests start with a common system prompt of
  --system-tokens tokens (BOS included, a multiple of the block size so its
  pages are whole prefix-cache blocks); the rest of a prompt is a window of
  real English text (a fixed corpus of sentences in this file, tokenized with
  the model's own tokenizer), so the model sees natural text.
- --frac-n4 of the requests ask for n=4 samples (temperature 0.8, seeds
  seed, seed+1, seed+2, seed+3); the others n=1 (temperature 0.8).

Sides (same model, same threads, same scheduler settings)
---------------------------------------------------------
- paged: ModelRunner(paged=True, block_size=--block-size,
  num_blocks=budget/block_size): pages, prefix cache, copy-on-write n=4.
- slab: ModelRunner(paged=False, n_seq_max=budget/n_ctx): one n_ctx slab per
  sequence (the naive allocator). It cannot fork, so an n=4 request is sent
  as 4 separate n=1 requests with the same 4 seeds, each with its own copy of
  the prompt (the honest "without sharing" baseline); the client request is
  done when all 4 are.
Both use LLMEngine + Scheduler(max_num_batched_tokens=--max-batched-tokens,
max_num_seqs=--max-num-seqs, preemption_mode=recompute).

Driver: one forward of a few tokens warms each runner up (graph allocation)
before its clock starts; then a single loop: submit every request whose arrival time has
passed, run one llm.step(), record; sleep until the next arrival when idle.

Metrics (per side)
------------------
- running sequences after every step: peak and time-weighted mean (weights =
  step wall time) over the busy period;
- completed client requests per minute and generated tokens/s over the
  makespan (t=0 to the last completion);
- queueing time: from the request's arrival time to the start of the step in
  which its first sequence was scheduled (mean, p95); end-to-end latency
  (arrival to last token of all its samples; mean, p95);
- rejections (request.error set) and preemptions (scheduler counter);
- KV utilization = tokens stored / token slots held: paged from the block
  pool (tokens_stored / (used blocks * block_size)), slab = tokens in the
  running sequences / (slabs in use * n_ctx); time-weighted mean over steps
  with anything held, and "under load" (steps that end with requests still
  waiting for admission). Occupancy = tokens stored / budget;
- prefix-cache hit rate (paged; blocks found in the cache / full blocks
  looked up) and tokens computed (prefill + decode, recompute included);
- KV memory of the n=4 requests (paged): after every step, for each live
  forked request, unique physical blocks over its live samples' block tables
  vs the sum of their table lengths (= 4 separate paged copies); reported
  right after the fork, after the first decode (copy-on-write of the last
  prompt page), at the last step with all 4 samples live, and as a ratio of
  sums over the request's lifetime. The slab side holds 4 * n_ctx slots for
  the same request.
- cpu share = process CPU time / (wall time * threads) during the steps, and
  other processes' CPU = CPU time the rest of the machine used during the
  side's run / (makespan * cores), from /proc/stat: the machine may be
  shared, and GGML's spinning thread pool slows down several-fold when another
  process holds a core, so a run with other_cpu_share above a few % is
  contended (load averages are recorded too).

Outputs: bench/results/serve_trace.{json,md,png}.
Run: python -m bench.serving.serve_trace [--num-requests N --budget-tokens T --n-ctx C
--seed S --threads K --rate R]
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, script_parser, write_results

# ---- the text the prompts are cut from (original sentences, plain English) ----

CORPUS = """\
The river town grew up around a wooden bridge that farmers used to bring grain to the market on Saturdays.
In the spring the water rose over the lower fields, and families moved their animals to the hills until it fell again.
A small school opened next to the church, and for many years a single teacher taught every child to read and count.
When the railway arrived, the old road along the river lost most of its traffic, and the inns closed one after another.
Engineers measure the strength of a beam by loading it slowly and recording how far it bends before it cracks.
A good bread dough needs flour, water, salt and time; the yeast does most of the work while the baker waits.
The library keeps its oldest maps in a cool room, where the light is low and the air is kept dry all year.
Bees find flowers by their colour and smell, and they tell each other where to fly with a short dance in the hive.
The orchestra tuned to a single note from the oboe before the conductor raised her hands and the hall fell silent.
Sailors once crossed the ocean by watching the stars, the colour of the water and the birds that flew near land.
A computer stores numbers as patterns of bits, and every program is finally a long list of simple steps.
The mountain path climbs through a pine forest, crosses a stream on flat stones and ends at a small lake.
In winter the village holds a market where people sell wool, cheese, honey and candles made by hand.
Doctors ask patients to describe their symptoms carefully, because small details often point to the cause.
The museum shows tools from the first farms: stone blades, clay pots and the bones of early sheep and goats.
A bicycle is efficient because almost all the energy from the rider's legs turns the wheels.
Every evening the lighthouse keeper climbed the stairs, cleaned the lens and lit the lamp before sunset.
The garden was planned so that something flowers in every month, from the snowdrops to the late roses.
Children learn a language by listening for years before they speak, and then they make rules of their own.
The company moved its offices to the old factory, keeping the brick walls and the tall windows.
Rain falls more often on the western side of the hills, so the forests there are thicker and greener.
A careful writer reads each sentence aloud to hear whether it is clear, and cuts every word it does not need.
The team tested the new engine for a week in the cold before they trusted it on a long journey.
Astronomers study light from distant stars to learn what they are made of and how fast they are moving.
The market square is quiet in the early morning, until the first vans arrive with fruit and vegetables.
Old houses in the valley were built with thick stone walls that keep the rooms cool in summer.
A chess player thinks several moves ahead, but the best players also know when to trust a simple plan.
The ferry leaves the harbour every hour, and on clear days you can see the islands from the upper deck.
Farmers rotate their crops so that the soil can rest and recover the nutrients that one plant takes out.
The city council voted to plant a thousand trees along the main streets over the next five years.
A clock keeps time with a pendulum or a crystal that swings or vibrates at a very steady rate.
Students in the workshop built a small boat from plywood, and it floated on its first try.
The storm passed during the night, leaving broken branches in the streets and a bright clear sky.
Good maps leave out most details, because a map that shows everything is as large as the land itself.
The baker opens before dawn, and the smell of fresh bread reaches the bus stop at the corner.
"""

SYSTEM_TEXT = (
    "You are a helpful and careful assistant. Answer the user's question in clear, plain "
    "English, using short paragraphs. If you are not sure about a fact, say so, and never "
    "invent sources. Keep the answer focused on what was asked, and end when the answer is "
    "complete. The user's text follows."
)


# ---- trace --------------------------------------------------------------------

@dataclass
class ClientRequest:
    index: int
    arrival: float            # seconds from the start of the run
    prompt: list[int]
    max_tokens: int
    n: int
    shared: bool
    seed: int


def lognormal(rng, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2   # so the (unclipped) mean is `mean`
    return rng.lognormal(mu, sigma, size)


def make_trace(tok, args) -> tuple[list[ClientRequest], dict]:
    rng = np.random.default_rng(args.seed)
    bos = [tok.bos_id] if (tok.add_bos and tok.bos_id is not None) else []
    sentences = [s.strip() for s in CORPUS.strip().splitlines() if s.strip()]
    sent_ids = [tok.encode(" " + s if i else s, add_special=False) for i, s in enumerate(sentences)]
    # stream of real text: the sentences in a seeded order, repeated
    order = rng.permutation(len(sentences))
    stream: list[int] = []
    starts: list[int] = []
    while len(stream) < 4 * args.n_ctx:
        for i in order:
            starts.append(len(stream))
            stream.extend(sent_ids[i])
        order = rng.permutation(len(sentences))
    system = (bos + tok.encode(SYSTEM_TEXT, add_special=False))[:args.system_tokens]
    if len(system) < args.system_tokens:   # pad with text so the prefix is whole pages
        system += stream[:args.system_tokens - len(system)]

    n = args.num_requests
    gaps = rng.exponential(1.0 / args.rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    p_hi = min(512, args.n_ctx // 2)
    plen = np.clip(np.rint(lognormal(rng, args.prompt_mean, args.sigma, n)), 16, p_hi).astype(int)
    olen = np.clip(np.rint(lognormal(rng, args.output_mean, args.sigma, n)), 4, 256).astype(int)
    shared = rng.random(n) < args.frac_shared
    n4 = rng.random(n) < args.frac_n4
    offs = rng.integers(0, len(starts), n)
    trace = []
    for i in range(n):
        head = system if shared[i] else bos
        user_len = max(int(plen[i]) - len(head), 16)
        s = starts[offs[i]]
        user = (stream[s:] + stream)[:user_len]
        prompt = head + user
        max_tokens = int(min(olen[i], args.n_ctx - len(prompt) - 1))
        trace.append(ClientRequest(i, float(arrivals[i]), prompt, max_tokens, 4 if n4[i] else 1,
                                   bool(shared[i]), args.seed * 100003 + 10 * i))
    plens = np.array([len(r.prompt) for r in trace])
    info = {
        "num_requests": n,
        "num_n4": int(n4.sum()),
        "num_shared_system": int(shared.sum()),
        "system_prompt_tokens": len(system),
        "prompt_tokens_mean": float(plens.mean()),
        "prompt_tokens_max": int(plens.max()),
        "max_tokens_mean": float(np.mean([r.max_tokens for r in trace])),
        "max_tokens_max": int(max(r.max_tokens for r in trace)),
        "sequences": int(sum(r.n for r in trace)),
        "last_arrival_s": float(arrivals[-1]),
        "corpus_tokens": len(stream),
    }
    return trace, info


# ---- one side -----------------------------------------------------------------

@dataclass
class Tracked:
    """One client request as one side serves it (slab: n engine requests)."""

    client: ClientRequest
    reqs: list = field(default_factory=list)
    admitted: float | None = None
    done: float | None = None
    error: str | None = None
    generated: int = 0


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def wmean(values, weights):
    v, w = np.asarray(values, float), np.asarray(weights, float)
    return float((v * w).sum() / w.sum()) if w.sum() > 0 else None


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time all processes have used (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_side(name: str, paged: bool, model, tok, trace: list[ClientRequest], args) -> dict:
    from pyllama_paged.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
    from pyllama_paged.engine.sched.request import RequestStatus

    budget = args.budget_tokens
    # paged: budget // block_size pages; slabs: the same tokens as whole n_ctx slabs
    llm = LLMEngine.from_config(EngineConfig(
        paged=paged, n_ctx=args.n_ctx, n_threads=args.threads, n_batch=args.max_batched_tokens,
        block_size=args.block_size, num_blocks=budget // args.block_size if paged else None,
        n_seq_max=max(1, budget // args.n_ctx),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, preemption_mode="recompute")),
        model=model, eot_ids=tok.eot_ids)
    runner = llm.runner
    assert runner.kv.paged == paged
    slots_total = runner.kv.num_blocks * runner.kv.block_size
    # warm-up outside the clock (a started server has done its first graph allocation):
    # one prompt shorter than a block, so the prefix cache sees nothing
    warm = runner.add_sequence(trace[0].prompt[:min(8, args.block_size - 1)])
    runner.step([(warm, warm.num_tokens)])
    runner.free(warm)

    def params(seed, n, max_tokens):
        return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=seed, n=n)

    tracked = [Tracked(c) for c in trace]
    owner = {}                     # engine request id -> Tracked
    unadmitted: list = []          # engine requests not yet scheduled once
    pending = list(tracked)
    pending.reverse()              # pop() from the end = next arrival
    live_n4 = {}                   # request id -> Tracked (paged, forked n=4)
    n4_mem: dict[int, dict] = {}   # client index -> memory samples
    samples = []
    load_start = os.getloadavg()
    cpu_step = wall_step = 0.0
    busy0, own0 = _cpu_busy_s(), time.process_time()
    t_start = time.monotonic()

    def now():
        return time.monotonic() - t_start

    while pending or llm.has_work():
        t = now()
        while pending and pending[-1].client.arrival <= t:
            tr = pending.pop()
            c = tr.client
            subs = [(c.seed, c.n)] if paged else [(c.seed + i, 1) for i in range(c.n)]
            for seed, n in subs:
                req = llm.add_request(c.prompt, params(seed, n, c.max_tokens))
                tr.reqs.append(req)
                owner[req.request_id] = tr
                if req.error:
                    tr.error = req.error
                else:
                    unadmitted.append(req)
            if tr.error:
                tr.done = t
        if not llm.has_work():
            if pending:
                time.sleep(max(0.0, pending[-1].client.arrival - now()))
            continue
        t0, c0 = now(), time.process_time()
        outs = llm.step()
        t1, c1 = now(), time.process_time()
        wall_step += t1 - t0
        cpu_step += c1 - c0
        for out in outs:
            tr = owner[out.request_id]
            tr.generated += len(out.events)
            if out.error:
                tr.error = out.error
            if out.finished:
                live_n4.pop(out.request_id, None)
                if all(r.status == RequestStatus.FINISHED for r in tr.reqs):
                    tr.done = t1
        still = []
        for req in unadmitted:
            if req.status != RequestStatus.WAITING or any(s.kv is not None for s in req.seqs):
                tr = owner[req.request_id]
                if tr.admitted is None:
                    tr.admitted = t0
            else:
                still.append(req)
        unadmitted = still

        # KV of the forked n=4 requests: unique blocks vs 4 separate copies
        if paged:
            for req in llm.scheduler.running:
                if req.params.n > 1 and req.is_forked:
                    live_n4[req.request_id] = owner[req.request_id]
            for rid, tr in list(live_n4.items()):
                req = llm.requests.get(rid)
                if req is None:
                    continue
                tables = [runner.kv.block_table(s.kv.handle) for s in req.seqs if s.kv is not None]
                if not tables:
                    continue
                total = int(sum(len(tb) for tb in tables))
                unique = len(set(np.concatenate(tables).tolist()))
                m = n4_mem.setdefault(tr.client.index, {"samples": []})
                m["samples"].append((len(tables), unique, total))

        st = llm.stats()
        running_tokens = sum(s.kv.num_tokens for r in llm.scheduler.running
                             for s in r.live_seqs if s.kv is not None)
        if paged:
            ps = runner.kv.pool.stats()
            stored, held, logical = ps.tokens_stored, ps.slots_held, ps.tokens_logical
        else:
            stored = logical = running_tokens
            held = st["blocks_used"] * runner.kv.block_size
        samples.append({
            "t": t1, "dt": t1 - t0, "running_seqs": st["running_seqs"],
            "running_requests": st["running_requests"], "waiting": st["waiting_requests"],
            "tokens_stored": stored, "slots_held": held, "tokens_logical": logical,
            "util": stored / held if held else None, "occupancy": stored / slots_total,
            "preemptions": st["preemptions"], "hit_rate": st.get("prefix_hit_rate"),
            "step_tokens": sum(len(o.events) for o in outs),
        })
    makespan = now()
    busy1, own1 = _cpu_busy_s(), time.process_time()
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    other_cpu = (None if busy0 is None or busy1 is None
                 else max(0.0, (busy1 - busy0) - (own1 - own0)) / (makespan * ncpu))
    load_end = os.getloadavg()
    final_stats = llm.stats()
    llm.close()

    # ---- summary
    dts = np.array([s["dt"] for s in samples])
    busy = [s for s in samples if s["slots_held"] > 0]
    loaded = [s for s in busy if s["waiting"] > 0]
    done = [tr for tr in tracked if tr.error is None and tr.done is not None]
    queue = [tr.admitted - tr.client.arrival for tr in done if tr.admitted is not None]
    e2e = [tr.done - tr.client.arrival for tr in done]
    gen = int(final_stats["generated_tokens"])
    summary = {
        "side": name,
        "paged": paged,
        "kv_slots": slots_total,
        "kv_layout": (f"{runner.kv.num_blocks} blocks x {runner.kv.block_size}" if paged
                      else f"{runner.kv.num_blocks} slabs x {runner.kv.block_size}"),
        "steps": len(samples),
        "makespan_s": makespan,
        "completed": len(done),
        "rejected": sum(tr.error is not None for tr in tracked),
        "preemptions": int(final_stats["preemptions"]),
        "peak_running_seqs": max(s["running_seqs"] for s in samples),
        "mean_running_seqs": wmean([s["running_seqs"] for s in samples], dts),
        "requests_per_min": 60.0 * len(done) / makespan,
        "generated_tokens": gen,
        "gen_tokens_per_s": gen / makespan,
        "computed_tokens": int(final_stats["computed_tokens"]),
        "prompt_tokens_offered": int(sum(len(tr.client.prompt) * (1 if paged else tr.client.n)
                                         for tr in tracked)),
        "queue_mean_s": float(np.mean(queue)) if queue else None,
        "queue_p95_s": pct(queue, 95),
        "e2e_mean_s": float(np.mean(e2e)) if e2e else None,
        "e2e_p95_s": pct(e2e, 95),
        "util_mean": wmean([s["util"] for s in busy], [s["dt"] for s in busy]) if busy else None,
        "util_under_load": (wmean([s["util"] for s in loaded], [s["dt"] for s in loaded])
                            if loaded else None),
        "loaded_fraction": (sum(s["dt"] for s in loaded) / dts.sum()) if len(dts) else None,
        "occupancy_mean": wmean([s["occupancy"] for s in busy], [s["dt"] for s in busy]) if busy else None,
        "occupancy_peak": max((s["occupancy"] for s in samples), default=None),
        "prefix_hit_rate": final_stats.get("prefix_hit_rate"),
        "cow_copies": final_stats.get("cow_copies"),
        "cpu_share": cpu_step / (wall_step * args.threads) if wall_step else None,
        "other_cpu_share": other_cpu,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "errors": sorted({tr.error for tr in tracked if tr.error})[:5],
    }
    n4 = summarize_n4(n4_mem, trace, args) if paged else None
    if n4 is not None:
        summary["n4"] = n4
    series = {k: [s[k] for s in samples] for k in ("t", "running_seqs", "waiting", "util",
                                                    "occupancy", "tokens_logical")}
    return {"summary": summary, "series": series}


def summarize_n4(mem: dict, trace, args) -> dict | None:
    """Paged KV of n=4 requests vs 4 separate copies (ratios of blocks)."""
    after_fork, after_decode, at_end, life_u, life_t = [], [], [], 0, 0
    per_request = []
    for idx, m in sorted(mem.items()):
        full = [(u, t) for k, u, t in m["samples"] if k == 4]
        if not full:
            continue
        after_fork.append(full[0][0] / full[0][1])
        if len(full) > 1:
            after_decode.append(full[1][0] / full[1][1])
        at_end.append(full[-1][0] / full[-1][1])
        life_u += sum(u for u, _ in full)
        life_t += sum(t for _, t in full)
        c = trace[idx]
        per_request.append({"request": idx, "prompt_tokens": len(c.prompt), "max_tokens": c.max_tokens,
                            "fork_blocks": full[0], "end_blocks": full[-1],
                            "lifetime_ratio": sum(u for u, _ in full) / sum(t for _, t in full)})
    if not per_request:
        return None
    end_slots = [r["end_blocks"][0] * args.block_size for r in per_request]
    return {
        "num_requests": len(per_request),
        "ratio_after_fork_mean": float(np.mean(after_fork)),
        "ratio_after_first_decode_mean": float(np.mean(after_decode)) if after_decode else None,
        "ratio_at_end_mean": float(np.mean(at_end)),
        "ratio_at_end_max": float(np.max(at_end)),
        "ratio_lifetime": life_u / life_t,
        "vs_slab_at_end_mean": float(np.mean([s / (4 * args.n_ctx) for s in end_slots])),
        "per_request": per_request,
    }


# ---- report -------------------------------------------------------------------

ROWS = [
    ("kv_layout", "KV budget layout"),
    ("peak_running_seqs", "peak running seqs"),
    ("mean_running_seqs", "mean running seqs"),
    ("completed", "requests completed"),
    ("rejected", "rejected"),
    ("preemptions", "preemptions"),
    ("makespan_s", "makespan (s)"),
    ("requests_per_min", "requests / min"),
    ("generated_tokens", "generated tokens"),
    ("gen_tokens_per_s", "generated tokens / s"),
    ("computed_tokens", "tokens computed (prefill+decode)"),
    ("queue_mean_s", "queueing mean (s)"),
    ("queue_p95_s", "queueing p95 (s)"),
    ("e2e_mean_s", "latency mean (s)"),
    ("e2e_p95_s", "latency p95 (s)"),
    ("util_mean", "KV utilization mean"),
    ("util_under_load", "KV utilization under load"),
    ("occupancy_mean", "KV occupancy mean (stored / budget)"),
    ("occupancy_peak", "KV occupancy peak"),
    ("prefix_hit_rate", "prefix-cache hit rate (blocks)"),
    ("cpu_share", "CPU share (cpu / wall / threads)"),
    ("other_cpu_share", "other processes' CPU (of all cores)"),
]
PERCENT = {"util_mean", "util_under_load", "occupancy_mean", "occupancy_peak", "prefix_hit_rate",
           "cpu_share", "other_cpu_share"}


def fmt_pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def table_rows(sides: dict) -> list[dict]:
    rows = []
    p, s = sides.get("paged"), sides.get("slab")
    for key, label in ROWS:
        row = {"metric": label}
        for name, d in (("paged", p), ("slab", s)):
            if d is None:
                continue
            v = d["summary"].get(key)
            row[name] = fmt_pct(v) if key in PERCENT else v
        if p and s:
            a, b = p["summary"].get(key), s["summary"].get(key)
            row["paged / slab"] = (f"{a / b:.2f}x" if isinstance(a, (int, float)) and
                                   isinstance(b, (int, float)) and b and key not in PERCENT
                                   else "")
        rows.append(row)
    return rows


def targets(sides: dict) -> list[dict]:
    p, s = sides["paged"]["summary"], sides["slab"]["summary"]
    n4 = p.get("n4") or {}
    out = [
        {"target": "paged >= 2x concurrent sequences (peak)",
         "value": f"{p['peak_running_seqs']} vs {s['peak_running_seqs']} "
                  f"({p['peak_running_seqs'] / s['peak_running_seqs']:.2f}x)",
         "met": p["peak_running_seqs"] >= 2 * s["peak_running_seqs"]},
        {"target": "paged >= 2x concurrent sequences (time mean)",
         "value": f"{p['mean_running_seqs']:.1f} vs {s['mean_running_seqs']:.1f} "
                  f"({p['mean_running_seqs'] / s['mean_running_seqs']:.2f}x)",
         "met": p["mean_running_seqs"] >= 2 * s["mean_running_seqs"]},
        {"target": "paged higher throughput (generated tokens/s)",
         "value": f"{p['gen_tokens_per_s']:.1f} vs {s['gen_tokens_per_s']:.1f} "
                  f"({p['gen_tokens_per_s'] / s['gen_tokens_per_s']:.2f}x)",
         "met": p["gen_tokens_per_s"] > s["gen_tokens_per_s"]},
        {"target": "paged higher throughput (requests/min)",
         "value": f"{p['requests_per_min']:.1f} vs {s['requests_per_min']:.1f} "
                  f"({p['requests_per_min'] / s['requests_per_min']:.2f}x)",
         "met": p["requests_per_min"] > s["requests_per_min"]},
        {"target": "paged KV utilization > 90% under load",
         "value": f"{fmt_pct(p['util_under_load'])} (slab {fmt_pct(s['util_under_load'])})",
         "met": p["util_under_load"] is not None and p["util_under_load"] > 0.9},
    ]
    if n4:
        out.append({"target": "n=4 KV <= 45% of 4 separate copies (lifetime)",
                    "value": f"{fmt_pct(n4['ratio_lifetime'])} (after fork "
                             f"{fmt_pct(n4['ratio_after_fork_mean'])}, at end "
                             f"{fmt_pct(n4['ratio_at_end_mean'])})",
                    "met": n4["ratio_lifetime"] <= 0.45})
        out.append({"target": "n=4 KV <= 45% of 4 separate copies (at end)",
                    "value": fmt_pct(n4["ratio_at_end_mean"]),
                    "met": n4["ratio_at_end_mean"] <= 0.45})
    return out


def plot(path: Path, sides: dict, title: str, budget: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"paged": "tab:blue", "slab": "tab:red"}
    fig, axes = plt.subplots(3, 1, figsize=(10, 9.5), sharex=True)
    for name, d in sides.items():
        ser, col = d["series"], colors[name]
        t = np.array(ser["t"])
        util = np.array([np.nan if u is None else 100 * u for u in ser["util"]])
        axes[0].step(t, util, where="post", color=col, lw=1.2, label=f"{name}: tokens / slots held")
        axes[0].step(t, 100 * np.array(ser["occupancy"]), where="post", color=col, lw=0.9, ls=":",
                     label=f"{name}: tokens / budget")
        axes[1].step(t, ser["running_seqs"], where="post", color=col, lw=1.2, label=f"{name}: running")
        axes[2].step(t, ser["waiting"], where="post", color=col, lw=1.2, label=f"{name}: waiting")
    axes[0].axhline(90, color="gray", lw=0.6, ls="--")
    axes[0].set_ylabel("KV utilization %")
    axes[0].set_ylim(0, 105)
    axes[0].legend(fontsize=7, loc="lower right", ncol=2)
    axes[0].set_title(title, fontsize=9)
    axes[1].set_ylabel("running sequences")
    axes[1].legend(fontsize=8, loc="upper right")
    axes[2].set_ylabel("waiting engine requests\n(slab: an n=4 request is 4)")
    axes[2].set_xlabel(f"wall time since the first arrival (s); same arrival times on both sides; "
                       f"KV budget {budget} tokens")
    axes[2].legend(fontsize=8, loc="upper right")
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--num-requests", type=int, default=40, help="client requests in the trace")
    ap.add_argument("--prompt-mean", type=float, default=120.0, help="mean prompt tokens (log-normal)")
    ap.add_argument("--output-mean", type=float, default=48.0, help="mean max_tokens (log-normal)")
    ap.add_argument("--sigma", type=float, default=0.6, help="log-normal sigma of both lengths")
    ap.add_argument("--frac-n4", type=float, default=0.25, help="fraction of requests with n=4")
    ap.add_argument("--frac-shared", type=float, default=0.4, help="fraction of requests with the common system prompt")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="scheduler max_num_seqs")
    ap.add_argument("--max-batched-tokens", type=int, default=256, help="scheduler max_num_batched_tokens (and n_batch)")
    add_options(ap, budget_tokens=8192, n_ctx=1024, block_size=16, seed=0, threads=2, rate=2.0, system_tokens=64,
                temperature=0.8, sides="paged,slab", model=None, out=str(RESULTS_DIR),
                helps={"n_ctx": "context = the slab size", "seed": "trace and sampling seed",
                       "system_tokens": "system prompt tokens (BOS included)", "sides": "which sides, in run order"})
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = ap.parse_args(argv)
    if args.budget_tokens % args.n_ctx or args.budget_tokens % args.block_size:
        ap.error("--budget-tokens must be a multiple of --n-ctx and of --block-size")

    from pyllama_paged.engine import Model
    from pyllama_paged.tokenizer.tokenizer import Tokenizer

    t_all = time.perf_counter()
    model = Model(args.model)
    tok = Tokenizer.from_metadata(model.metadata)
    trace, trace_info = make_trace(tok, args)
    cfg = model.config
    kv_bytes_per_token = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 2   # K and V, f16
    print(f"trace: {trace_info}", flush=True)
    sides = {}
    for name in [s.strip() for s in args.sides.split(",") if s.strip()]:
        print(f"running {name} ...", flush=True)
        sides[name] = run_side(name, name == "paged", model, tok, trace, args)
        sm = sides[name]["summary"]
        print(f"  {name}: {sm['completed']} done in {sm['makespan_s']:.1f} s, peak {sm['peak_running_seqs']} "
              f"seqs, {sm['gen_tokens_per_s']:.1f} gen tok/s, load {sm['loadavg_start']} -> "
              f"{sm['loadavg_end']}, other processes' CPU {fmt_pct(sm['other_cpu_share'])}", flush=True)

    rows = table_rows(sides)
    tgt = targets(sides) if {"paged", "slab"} <= sides.keys() else []
    params = {k: getattr(args, k) for k in ("num_requests", "budget_tokens", "n_ctx", "block_size", "seed",
                                            "threads", "rate", "prompt_mean", "output_mean", "sigma",
                                            "frac_n4", "frac_shared", "system_tokens", "temperature",
                                            "max_num_seqs", "max_batched_tokens", "sides")}
    params["preemption_mode"] = "recompute"
    params["model"] = Path(model.path).name
    params["kv_cache_type"] = "f16"
    params["kv_bytes_per_token"] = kv_bytes_per_token
    params["kv_budget_mib"] = args.budget_tokens * kv_bytes_per_token / 2**20
    title = (f"Serving trace: paged vs slab KV, same budget of {args.budget_tokens} tokens "
             f"({params['kv_budget_mib']:.0f} MiB f16), {args.num_requests} requests")

    n4 = sides.get("paged", {}).get("summary", {}).get("n4")
    notes = [
        f"Model {params['model']}, {args.threads} threads, CPU. Trace (seed {args.seed}): "
        f"{trace_info['num_requests']} requests, Poisson {args.rate} req/s (last arrival at "
        f"{trace_info['last_arrival_s']:.1f} s), prompt mean {trace_info['prompt_tokens_mean']:.0f} tokens "
        f"(max {trace_info['prompt_tokens_max']}), max_tokens mean {trace_info['max_tokens_mean']:.0f} "
        f"(max {trace_info['max_tokens_max']}; a sample also stops at end-of-turn), "
        f"{trace_info['num_n4']} requests with n=4, {trace_info['num_shared_system']} with the common "
        f"{trace_info['system_prompt_tokens']}-token system prompt; {trace_info['sequences']} sequences "
        f"in all. Paged: {sides['paged']['summary']['kv_layout'] if 'paged' in sides else '-'} tokens; "
        f"slab: {sides['slab']['summary']['kv_layout'] if 'slab' in sides else '-'} tokens "
        f"(n=4 sent as 4 n=1 requests). Scheduler: max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_batched_tokens}, recompute preemption.",
        "",
        "Queueing = arrival to the first step that schedules the request; latency = arrival to "
        "its last token (all n samples). Utilization = tokens stored / token slots held "
        "(time-weighted over steps; 'under load' = steps ending with requests still waiting). "
        "Occupancy = tokens stored / whole budget. Throughput is over the makespan (t=0 to the "
        "last completion). CPU share = this process's CPU time / (step wall time * threads); "
        "other processes' CPU = CPU time used by everything else on the machine during the side's "
        "run / (makespan * cores), from /proc/stat: well above a few % means the numbers are "
        "contended (GGML's spinning thread pool slows down several-fold when another process "
        "holds a core).",
    ]
    if tgt:
        notes += ["", "Targets:", "", markdown_table(tgt, ["target", "value", "met"])]
    if n4:
        notes += ["", f"KV of the {n4['num_requests']} n=4 requests on the paged side (unique physical "
                  "blocks of its live samples / the blocks 4 separate copies would hold): "
                  f"right after the fork {fmt_pct(n4['ratio_after_fork_mean'])}, after the first "
                  f"decode (copy-on-write of the last prompt page) "
                  f"{fmt_pct(n4['ratio_after_first_decode_mean'])}, at the last step with all 4 samples "
                  f"live {fmt_pct(n4['ratio_at_end_mean'])} (worst {fmt_pct(n4['ratio_at_end_max'])}), "
                  f"over each request's lifetime {fmt_pct(n4['ratio_lifetime'])}. "
                  f"Against the slab side (4 slabs of {args.n_ctx} tokens) the same requests hold "
                  f"{fmt_pct(n4['vs_slab_at_end_mean'])} at the end."]
    ps = sides.get("paged", {}).get("summary")
    if ps:
        obs = []
        if ps["peak_running_seqs"] > args.max_num_seqs:
            obs.append(f"the paged peak of {ps['peak_running_seqs']} running sequences exceeds "
                       f"max_num_seqs {args.max_num_seqs}: the scheduler counts an n=4 request as one "
                       "sequence when it admits it, and the request forks into 4 after its prefill")
        if ps["occupancy_peak"] < 0.9 and ps["preemptions"] == 0:
            obs.append(f"the paged pool never filled (peak occupancy {fmt_pct(ps['occupancy_peak'])}, "
                       "no preemptions): in this run the paged side was limited by compute (prefill "
                       "chunks admitted under max_num_batched_tokens per step) and max_num_seqs, not by "
                       "KV memory; a smaller --budget-tokens puts it in the KV-bound regime")
        if obs:
            notes += ["", "Observations: " + "; ".join(obs) + "."]
    out = Path(args.out)
    if not args.no_plot and sides:
        out.mkdir(parents=True, exist_ok=True)
        plot(out / "serve_trace.png", sides, title, args.budget_tokens)
    data = {"params": params, "trace": trace_info, "targets": tgt,
            "sides": {k: v["summary"] for k, v in sides.items()},
            "series": {k: v["series"] for k, v in sides.items()},
            "wall_s": time.perf_counter() - t_all}
    paths = write_results("serve_trace", data, rows, out_dir=out, title=title, notes="\n".join(notes))
    print(title)
    print(markdown_table(rows))
    if tgt:
        print(markdown_table(tgt, ["target", "value", "met"]))
    print(f"wrote {paths['json']}, {paths['md']}" + ("" if args.no_plot else f", {out / 'serve_trace.png'}")
          + f" in {data['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
