"""Soak test of the HTTP server (not part of pytest/CI): `pyllama-paged serve`
in a subprocess with a KV pool small enough to force preemption, N streaming
clients for T minutes against both APIs, a health prober, and the server's
memory, file descriptors and pool figures recorded over time. Writes
bench/results/soak[_LABEL].{json,md,png}; the server's stdout/stderr go to
bench/results/soak[_LABEL].server.log (not committed).

    python -m bench.serving.soak                          # 64 clients, 30 minutes
    python -m bench.serving.soak --clients 16 --minutes 2 --label short

Server: the embedded default model, --threads 2, --kv-budget tokens in pages of
--block-size (default: 64 tokens per client, at least 2048, i.e. far less than
the load holds at once, so the scheduler preempts), on a free loopback port.

Load: --clients tasks, each its own HTTP connection (httpx), send one request
after another (0 to --think seconds apart) until the time is up. Each request
is drawn (seeded) from:
- API: Ollama /api/generate and /api/chat, OpenAI /v1/chat/completions and
  /v1/completions, a quarter each;
- streaming (--stream-share) or not; --hangup-share of the streaming ones hang
  up on purpose after 0..5 content chunks (0: right after the headers, i.e.
  while queued or in prefill);
- OpenAI requests ask for n=2..4 samples with probability --n-share;
- greedy (40%) or temperature 0.6..1.2 (with a seed half of the time);
  10% carry a stop string;
- prompt: a short question, a medium one (1-2 paragraphs) or a long one
  (4-6 paragraphs, ~500 tokens); 60% start with one of three shared system
  prompts (several full pages each, so the prefix cache hits);
- max_tokens / num_predict uniform in [--min-tokens, --max-tokens].
Every answer is checked: HTTP status, NDJSON/SSE framing, a final `done` /
`data: [DONE]`, a finish_reason for each of the n choices, usage.

Alongside: a prober thread GETs /, /api/version, /api/tags in turn every second
(a failure: non-200, transport error, or slower than --probe-timeout); a
sampler thread reads the server's /proc/<pid>/status (VmRSS, VmHWM, threads),
its open file descriptors and CPU time, and /api/pool's stats every
--sample-every seconds.

Before the load: one greedy completion (kept for comparison) and an abort
check (a long stream hung up after 3 chunks must leave the scheduler within
10 s). After the load: every client is cancelled mid-request (a burst of
disconnects), the script waits until no request is running, waiting or
swapped, then reads the pool: leaked blocks = blocks_used (must be 0). The
same greedy completion must give the same text; the pool must be empty again;
/metrics must show no 5xx; the server must exit cleanly on SIGINT with no
traceback in its log. RSS has levelled off when the mean of the last third of
the load is within --rss-tolerance of the middle third's; the slope over the
last half is reported in MiB/min.

Exit status 0 when every check passed, 1 otherwise (the failed checks are
listed in the markdown and the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from bench.common.options import add_options
from bench.common.report import RESULTS_DIR, markdown_table, save_figure, write_results
from pyllama_paged.testing.serving import free_port, wait_healthy

APIS = ("ollama/generate", "ollama/chat", "openai/chat", "openai/completions")
PATHS = {"ollama/generate": "/api/generate", "ollama/chat": "/api/chat",
         "openai/chat": "/v1/chat/completions", "openai/completions": "/v1/completions"}
PROBE_PATHS = ("/", "/api/version", "/api/tags")
GREEDY_PROMPT = "The three primary colors are"

SYSTEM_PROMPTS = [
    "You are a careful assistant for a public library. Answer the visitor's question in plain "
    "language, in at most three short paragraphs. When a question concerns opening hours, "
    "membership, borrowing limits or fines, say that the front desk has the current figures and "
    "do not invent numbers. Prefer concrete examples over general advice, avoid lists unless the "
    "visitor asks for one, and never mention that you are a program. If the question is unclear, "
    "ask one short clarifying question instead of guessing what the visitor meant.",
    "You are a patient science tutor for teenagers. Explain the idea behind the student's question "
    "step by step, starting from something they already know from daily life, and only then give "
    "the textbook term. Use one analogy at most, keep every sentence short, and finish with a "
    "single question the student can answer to check that they understood. Do not use formulas "
    "unless the student wrote one first. If the student is wrong, say what is right about their "
    "answer before correcting the rest of it, and never make fun of a question.",
    "You write short product descriptions for an online shop that sells kitchen tools, garden "
    "equipment and camping gear. Describe what the item is for, who will like it and one thing "
    "to watch out for when using it. Write in a friendly tone without exclamation marks, do not "
    "claim anything you were not told, and keep the whole description under one hundred words. "
    "If the request is not about a product, reply politely that you can only help with product "
    "descriptions, and suggest what kind of information the customer could send instead.",
]

QUESTIONS = [
    "Why is the sky blue?", "Write a haiku about rivers.", "What is a prime number?",
    "Describe a cat in three sentences.", "How do airplanes stay in the air?", "Name five fruits.",
    "What is the capital of Japan?", "Explain photosynthesis simply.", "How does a compass work?",
    "Why do leaves change colour in autumn?", "What makes bread rise?", "Summarize the text above.",
    "Give the text above a title.", "What is the main idea of the text above?",
    "Write a limerick about a lighthouse.", "How far away is the Moon?",
]

PASSAGES = [
    "The old harbour town woke slowly. Fishing boats came back before sunrise, their decks covered "
    "in nets and crates, and the smell of salt and diesel drifted up the narrow streets. By seven "
    "the bakery had its first queue, mostly dock workers who bought bread still too hot to hold, "
    "and by eight the market square filled with stalls selling fish, onions, honey and knives.",
    "A river does not flow in a straight line for long. Wherever the bank is a little softer, the "
    "water cuts into it and deposits sand on the opposite side, so a small bend grows into a "
    "loop. Over centuries the loops wander across the valley floor, and when two of them touch, "
    "the river takes the shortcut and leaves behind a curved lake that slowly fills with reeds.",
    "Early mechanical clocks had no minute hand. They were built for church towers and rang the "
    "hours, and they drifted by a quarter of an hour a day, which nobody minded because the sun "
    "was the real reference. Only when the pendulum was introduced did clocks become precise "
    "enough that a minute hand made sense, and within a few decades it appeared on most of them.",
    "Honeybees find their way home using the position of the sun, even when it is hidden behind "
    "clouds, because they can see the pattern of polarized light in the sky. A forager that has "
    "found a good patch of flowers returns to the hive and dances on the comb: the angle of the "
    "dance tells the others the direction, and its duration tells them how far they must fly.",
    "The first long railway lines forced towns to agree on the time. Before them every town kept "
    "its own local noon, a few minutes earlier or later than its neighbours, and timetables "
    "listed both the local time and the time of the company's headquarters. Standard time zones "
    "were adopted within a generation, first by the railways and only later by law.",
    "Bread dough rises because yeast feeds on the sugars in the flour and releases carbon dioxide. "
    "Kneading builds a network of gluten that traps the gas in small bubbles, and in the oven the "
    "bubbles expand until the crust sets. A dough that rose too long collapses, because the gluten "
    "has been stretched so thin that it tears, and the loaf comes out flat and sour.",
    "Lighthouses once burned wood, then oil, then paraffin, and each change made the light "
    "brighter and more reliable. The great improvement was the Fresnel lens, a stack of glass "
    "rings that bends almost all the light of a small flame into one horizontal beam. Rotating "
    "the lens gives every lighthouse its own rhythm of flashes, so sailors can tell them apart.",
]

CHAT_HISTORY = [{"role": "user", "content": "Hello, are you there?"},
                {"role": "assistant", "content": "Yes, I am here. What would you like to know?"}]


# ---- the request mix -----------------------------------------------------------

@dataclass
class Job:
    api: str
    body: dict
    stream: bool
    n: int
    prompt_class: str
    hangup_after: int | None        # content chunks before hanging up; None: read to the end
    include_usage: bool = False

    @property
    def path(self) -> str:
        return PATHS[self.api]


def make_job(rng: random.Random, model: str, args) -> Job:
    api = rng.choice(APIS)
    stream = rng.random() < args.stream_share
    hangup = rng.randint(0, 5) if stream and rng.random() < args.hangup_share else None
    r = rng.random()
    if r < 0.45:
        prompt_class, paragraphs = "short", []
    elif r < 0.8:
        prompt_class, paragraphs = "medium", rng.sample(PASSAGES, rng.randint(1, 2))
    else:
        prompt_class, paragraphs = "long", rng.sample(PASSAGES, rng.randint(4, 6))
    user = "\n\n".join(paragraphs + [rng.choice(QUESTIONS)])
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.6 else None
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    greedy = rng.random() < 0.4
    temperature = 0.0 if greedy else round(rng.uniform(0.6, 1.2), 2)
    seed = rng.randint(0, 2**31 - 1) if not greedy and rng.random() < 0.5 else None
    stop = [rng.choice(["\n\n", ".", "\n"])] if rng.random() < 0.1 else None
    n = 1
    if api.startswith("ollama"):
        options = {"num_predict": max_tokens, "temperature": temperature, "top_k": 40, "top_p": 0.9}
        if seed is not None:
            options["seed"] = seed
        if stop:
            options["stop"] = stop
        body = {"model": model, "stream": stream, "options": options}
        if api == "ollama/generate":
            body["prompt"] = user
            if system:
                body["system"] = system
        else:
            history = CHAT_HISTORY if rng.random() < 0.2 else []
            body["messages"] = ([{"role": "system", "content": system}] if system else []) + history + \
                               [{"role": "user", "content": user}]
    else:
        if rng.random() < args.n_share:
            n = rng.randint(2, 4)
            if greedy:   # n identical greedy samples would be pointless
                temperature = round(rng.uniform(0.6, 1.2), 2)
        body = {"model": model, "stream": stream, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": 0.95, "n": n}
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        if api == "openai/chat":
            body["messages"] = ([{"role": "system", "content": system}] if system else []) + \
                               [{"role": "user", "content": user}]
        else:
            body["prompt"] = (system + "\n\n" if system else "") + user
    include_usage = False
    if stream and api.startswith("openai") and rng.random() < 0.7:
        body["stream_options"] = {"include_usage": True}
        include_usage = True
    return Job(api, body, stream, n, prompt_class, hangup, include_usage)


# ---- answers: parse and check ------------------------------------------------------

class ProtocolViolation(Exception):
    """The server answered 200 but broke the API's framing or shape."""


class StreamParser:
    """Checks one streamed answer line by line; counts content chunks and tokens."""

    def __init__(self, job: Job):
        self.job = job
        self.chunks = 0          # chunks carrying text
        self.done = False
        self.tokens: int | None = None
        self.finished: set[int] = set()
        self.usage_seen = False

    def feed(self, line: str) -> int:
        """Parse one line; returns how many content chunks it carried."""
        line = line.strip()
        if not line:
            return 0
        if self.job.api.startswith("ollama"):
            return self._ollama(line)
        return self._sse(line)

    def _load(self, text: str) -> dict:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            raise ProtocolViolation("malformed JSON line") from None
        if not isinstance(obj, dict):
            raise ProtocolViolation("line is not an object")
        if "error" in obj:
            error = obj["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ProtocolViolation(f"error in the stream: {str(message)[:100]}")
        return obj

    def _ollama(self, line: str) -> int:
        if self.done:
            raise ProtocolViolation("data after done")
        obj = self._load(line)
        if obj.get("done"):
            self.done = True
            self.tokens = obj.get("eval_count")
            if "done_reason" not in obj:
                raise ProtocolViolation("final object without done_reason")
            return 0
        text = obj.get("response") if self.job.api == "ollama/generate" else obj.get("message", {}).get("content")
        if not isinstance(text, str):
            raise ProtocolViolation("chunk without text")
        if text:
            self.chunks += 1
            return 1
        return 0

    def _sse(self, line: str) -> int:
        if line.startswith(":"):
            return 0   # SSE comment
        if not line.startswith("data:"):
            raise ProtocolViolation("non-SSE line")
        data = line[5:].strip()
        if self.done:
            raise ProtocolViolation("data after [DONE]")
        if data == "[DONE]":
            self.done = True
            return 0
        obj = self._load(data)
        if "usage" in obj and obj.get("usage"):
            self.usage_seen = True
            self.tokens = obj["usage"].get("completion_tokens")
        count = 0
        for choice in obj.get("choices", []):
            index = choice.get("index")
            if not isinstance(index, int) or not 0 <= index < self.job.n:
                raise ProtocolViolation("choice index out of range")
            text = choice.get("text") if self.job.api == "openai/completions" else \
                choice.get("delta", {}).get("content")
            if text:
                count += 1
            if choice.get("finish_reason"):
                if index in self.finished:
                    raise ProtocolViolation("two finish_reasons for one choice")
                self.finished.add(index)
        self.chunks += count
        return count

    def finish(self) -> int:
        """At the end of a stream read to the end: its completeness; returns the tokens."""
        if not self.done:
            raise ProtocolViolation("stream ended without done / [DONE]")
        if self.job.api.startswith("openai"):
            if self.finished != set(range(self.job.n)):
                raise ProtocolViolation("a choice without finish_reason")
            if self.job.include_usage and not self.usage_seen:
                raise ProtocolViolation("no usage chunk")
        return self.tokens if isinstance(self.tokens, int) else self.chunks


def check_whole(job: Job, obj) -> int:
    """Checks a non-streamed answer; returns its tokens."""
    if not isinstance(obj, dict):
        raise ProtocolViolation("answer is not an object")
    if job.api.startswith("ollama"):
        if obj.get("done") is not True or "done_reason" not in obj:
            raise ProtocolViolation("answer not done")
        text = obj.get("response") if job.api == "ollama/generate" else obj.get("message", {}).get("content")
        if not isinstance(text, str):
            raise ProtocolViolation("answer without text")
        return int(obj.get("eval_count", 0))
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != job.n:
        raise ProtocolViolation("wrong number of choices")
    if any(not c.get("finish_reason") for c in choices):
        raise ProtocolViolation("a choice without finish_reason")
    usage = obj.get("usage") or {}
    if "completion_tokens" not in usage:
        raise ProtocolViolation("no usage")
    return int(usage["completion_tokens"])


def _clip(text: str, limit: int = 1500) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more]"


def _shorten(body: dict) -> dict:
    """A request body for the report, prompts clipped."""
    out = json.loads(json.dumps(body))
    if "prompt" in out:
        out["prompt"] = _clip(out["prompt"], 200)
    for m in out.get("messages", []):
        m["content"] = _clip(m["content"], 200)
    return out


# ---- the load ---------------------------------------------------------------

class Recorder:
    """Everything the clients observe; shared by the asyncio tasks."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.records: list[dict] = []
        self.error_examples: dict[str, list[dict]] = defaultdict(list)
        self.inflight = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def error(self, rec: dict, job: Job, kind: str, status: int | None = None, body: str = "") -> dict:
        rec.update(outcome="error", error=kind, status=status)
        examples = self.error_examples[kind]
        if len(examples) < 3:
            examples.append({"t": round(rec["t"], 2), "path": job.path, "request": _shorten(job.body),
                             "status": status, "response": _clip(body)})
        return rec


async def run_job(http: httpx.AsyncClient, job: Job, rec_: Recorder) -> dict:
    """Send one request, read (or hang up on) its answer, check it; returns its record."""
    rec = {"t": rec_.now(), "api": job.api, "stream": job.stream, "n": job.n, "prompt": job.prompt_class,
           "hangup_after": job.hangup_after, "outcome": None, "tokens": 0, "ttft": None, "latency": None}
    start = time.perf_counter()
    try:
        if job.stream:
            async with http.stream("POST", job.path, json=job.body) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    body = (await r.aread()).decode(errors="replace")
                    return rec_.error(rec, job, f"HTTP {r.status_code}", r.status_code, body)
                if job.hangup_after == 0:
                    rec.update(outcome="hangup", latency=time.perf_counter() - start)
                    return rec
                parser = StreamParser(job)
                async for line in r.aiter_lines():
                    if parser.feed(line) and rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - start
                    if job.hangup_after is not None and not parser.done and parser.chunks >= job.hangup_after:
                        rec.update(outcome="hangup", tokens=parser.chunks, latency=time.perf_counter() - start)
                        return rec   # leaving the block closes the connection mid-stream
                rec["tokens"] = parser.finish()
        else:
            r = await http.post(job.path, json=job.body)
            rec["status"] = r.status_code
            if r.status_code != 200:
                return rec_.error(rec, job, f"HTTP {r.status_code}", r.status_code, r.text)
            try:
                obj = r.json()
            except json.JSONDecodeError:
                raise ProtocolViolation("answer is not JSON") from None
            rec["tokens"] = check_whole(job, obj)
    except ProtocolViolation as e:
        return rec_.error(rec, job, f"protocol: {e}", rec.get("status"))
    except httpx.HTTPError as e:
        return rec_.error(rec, job, type(e).__name__, rec.get("status"), str(e))
    rec.update(outcome="ok", latency=time.perf_counter() - start)
    return rec


async def client_loop(i: int, url: str, model: str, args, rec_: Recorder, stop: asyncio.Event) -> None:
    rng = random.Random(args.seed * 100_003 + i)
    timeout = httpx.Timeout(connect=10, read=args.request_timeout, write=30, pool=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        await asyncio.sleep(rng.uniform(0, min(5.0, args.minutes * 6)))   # stagger the start
        while not stop.is_set():
            job = make_job(rng, model, args)
            t = rec_.now()
            rec_.inflight += 1
            try:
                rec = await run_job(http, job, rec_)
            except asyncio.CancelledError:   # the load is over: this request is abandoned
                rec_.records.append({"t": t, "api": job.api, "stream": job.stream, "n": job.n,
                                     "prompt": job.prompt_class, "hangup_after": job.hangup_after,
                                     "outcome": "cancelled", "tokens": 0, "ttft": None, "latency": None,
                                     "t_end": rec_.now()})
                raise
            finally:
                rec_.inflight -= 1
            rec["t_end"] = rec_.now()
            rec_.records.append(rec)
            await asyncio.sleep(rng.uniform(0, args.think))


async def run_load(url: str, model: str, args, rec_: Recorder, proc: subprocess.Popen,
                   samples: list[dict]) -> dict:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    interrupted = {"sigint": False, "server_died": False}

    def on_sigint():
        interrupted["sigint"] = True
        stop.set()
    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):
        pass

    async def watchdog():
        last_print = 0.0
        while not stop.is_set():
            if proc.poll() is not None:
                interrupted["server_died"] = True
                stop.set()
                return
            if rec_.now() - last_print >= args.progress_every:
                last_print = rec_.now()
                print(progress_line(rec_, samples), flush=True)
            await asyncio.sleep(1.0)

    tasks = [asyncio.create_task(client_loop(i, url, model, args, rec_, stop)) for i in range(args.clients)]
    dog = asyncio.create_task(watchdog())
    try:
        await asyncio.wait_for(stop.wait(), timeout=args.minutes * 60)
    except asyncio.TimeoutError:
        pass
    stop.set()
    inflight = rec_.inflight
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await dog
    crashed = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
    try:
        loop.remove_signal_handler(signal.SIGINT)
    except (NotImplementedError, RuntimeError):
        pass
    return {"load_s": rec_.now(), "inflight_at_stop": inflight, **interrupted,
            "client_task_crashes": [repr(c) for c in crashed]}


def progress_line(rec_: Recorder, samples: list[dict]) -> str:
    outcomes = Counter(r["outcome"] for r in rec_.records)
    s = samples[-1] if samples else {}
    return (f"[{rec_.now() / 60:5.1f} min] ok {outcomes['ok']}, hung up {outcomes['hangup']}, "
            f"errors {outcomes['error']}, in flight {rec_.inflight}; RSS {s.get('rss_mib', 0):.0f} MiB, "
            f"blocks used {s.get('blocks_used', '-')}/{s.get('blocks_total', '-')}, "
            f"running {s.get('running_requests', '-')}, waiting {s.get('waiting_requests', '-')}, "
            f"preemptions {s.get('preemptions', '-')}")


# ---- the server process and its observers --------------------------------------------

def server_command(args, port: int, budget: int) -> list[str]:
    exe = Path(sys.executable).parent / "pyllama-paged"
    if not exe.exists():
        found = shutil.which("pyllama-paged")
        exe = Path(found) if found else None
    cmd = [str(exe)] if exe else [sys.executable, "-m", "pyllama_paged.cli"]
    return cmd + ["serve", "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
                  "--ctx", str(args.ctx), "--block-size", str(args.block_size), "--kv-budget", str(budget),
                  "--max-seqs", str(args.max_seqs), "--preemption", args.preemption]


def proc_figures(pid: int) -> dict:
    """The server process's memory, threads, open files and CPU seconds (Linux /proc)."""
    out: dict = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key.lower().replace("vm", "") + "_mib"] = int(value.split()[0]) / 1024
                elif key == "Threads":
                    out["threads"] = int(value)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return out


POOL_KEYS = ("running_requests", "waiting_requests", "swapped_requests", "running_seqs", "preemptions",
             "generated_tokens", "computed_tokens", "blocks_total", "blocks_free", "blocks_used",
             "blocks_cached", "blocks_shared", "utilization", "prefix_hit_rate", "cow_copies")


def pool_stats(http: httpx.Client) -> dict:
    snap = http.get("/api/pool")
    snap.raise_for_status()
    body = snap.json()
    stats = {k: body["stats"][k] for k in POOL_KEYS if k in body["stats"]}
    states = Counter(body.get("blocks", []))
    stats["blocks_states"] = dict(states)
    return stats


class Sampler(threading.Thread):
    """Every `period` seconds: /proc figures of the server and its /api/pool stats."""

    def __init__(self, url: str, pid: int, period: float, t0: float):
        super().__init__(daemon=True, name="soak-sampler")
        self.url, self.pid, self.period, self.t0 = url, pid, period, t0
        self.samples: list[dict] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            next_t = time.monotonic()
            while not self.stop_event.is_set():
                s = {"t": time.monotonic() - self.t0, **proc_figures(self.pid)}
                start = time.perf_counter()
                try:
                    s.update(pool_stats(http))
                    s["pool_latency_s"] = time.perf_counter() - start
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    s["pool_error"] = type(e).__name__
                self.samples.append(s)
                next_t += self.period
                self.stop_event.wait(max(0.0, next_t - time.monotonic()))


class Prober(threading.Thread):
    """Every second: one cheap GET (/, /api/version, /api/tags in turn); latency and failures."""

    def __init__(self, url: str, timeout: float, t0: float):
        super().__init__(daemon=True, name="soak-prober")
        self.url, self.timeout, self.t0 = url, timeout, t0
        self.probes: list[dict] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
            next_t, k = time.monotonic(), 0
            while not self.stop_event.is_set():
                path = PROBE_PATHS[k % len(PROBE_PATHS)]
                k += 1
                p = {"t": time.monotonic() - self.t0, "path": path}
                start = time.perf_counter()
                try:
                    r = http.get(path)
                    p["latency_s"] = time.perf_counter() - start
                    p["ok"] = r.status_code == 200 and p["latency_s"] <= self.timeout
                    if not p["ok"]:
                        p["error"] = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    p.update(latency_s=time.perf_counter() - start, ok=False, error=type(e).__name__)
                self.probes.append(p)
                next_t += 1.0
                self.stop_event.wait(max(0.0, next_t - time.monotonic()))


def greedy_text(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"model": model, "prompt": GREEDY_PROMPT, "max_tokens": 32, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def wait_idle(http: httpx.Client, timeout: float) -> tuple[float | None, dict]:
    """Poll the pool until nothing runs, waits or is swapped; (seconds taken or None, last stats)."""
    start = time.monotonic()
    stats: dict = {}
    while time.monotonic() - start < timeout:
        try:
            stats = pool_stats(http)
            if not (stats.get("running_requests") or stats.get("waiting_requests")
                    or stats.get("swapped_requests")):
                return time.monotonic() - start, stats
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return None, stats


def abort_check(url: str, model: str, http: httpx.Client) -> dict:
    """A long greedy stream hung up after 3 chunks must leave the scheduler within 10 s."""
    body = {"model": model, "prompt": "Count from one to one thousand, in words:", "max_tokens": 1000,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks >= 3:
                        break
    seconds, stats = wait_idle(http, 10)
    return {"chunks_read": chunks, "idle_after_s": seconds, "blocks_used": stats.get("blocks_used"),
            "ok": seconds is not None and stats.get("blocks_used") == 0}


def scrape_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=60).text
    requests = {}
    for m in re.finditer(r'^pyllama_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M):
        requests[f"{m.group(1)} {m.group(2)}"] = int(float(m.group(3)))
    gen = re.search(r"^pyllama_generated_tokens_total (\S+)$", text, re.M)
    return {"requests": requests, "generated_tokens_total": int(float(gen.group(1))) if gen else None,
            "server_5xx": sum(v for k, v in requests.items() if k.split()[-1].startswith("5"))}


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> dict:
    if proc.poll() is not None:
        return {"returncode": proc.returncode, "already_exited": True, "shutdown_s": 0.0}
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
        return {"returncode": proc.returncode, "already_exited": False,
                "shutdown_s": round(time.monotonic() - start, 2)}
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return {"returncode": proc.returncode, "already_exited": False, "killed_after_s": timeout}


def tracebacks_in(log_text: str) -> tuple[int, list[str]]:
    """The number of Python tracebacks in the server's log and the distinct ones (by last line)."""
    lines = log_text.splitlines()
    found, seen, total = [], set(), 0
    i = 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last)"):
            block = [lines[i]]
            i += 1
            while i < len(lines):
                block.append(lines[i])
                line = lines[i]
                i += 1
                if line and not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
                    if not (line.startswith("During handling") or line.startswith("The above exception")):
                        break
            total += 1
            if block[-1] not in seen:
                seen.add(block[-1])
                found.append("\n".join(block))
            continue
        i += 1
    return total, found


# ---- analysis -------------------------------------------------------------------

def pct(xs, p):
    return float(np.percentile(xs, p)) if len(xs) else None


def rss_trend(samples: list[dict], load_s: float, tolerance: float) -> dict:
    """Mean RSS of the middle vs the last third of the load; slope over its last half."""
    pts = [(s["t"], s["rss_mib"]) for s in samples if "rss_mib" in s and 0 <= s["t"] <= load_s]
    if len(pts) < 6:
        return {"levelled": None, "note": "too few samples"}
    t = np.array([p[0] for p in pts])
    rss = np.array([p[1] for p in pts])
    mid = rss[(t >= load_s / 3) & (t < 2 * load_s / 3)]
    last = rss[t >= 2 * load_s / 3]
    half = t >= load_s / 2
    slope = float(np.polyfit(t[half] / 60, rss[half], 1)[0]) if half.sum() >= 2 else None
    mid_mean, last_mean = float(mid.mean()), float(last.mean())
    growth = (last_mean - mid_mean) / mid_mean
    return {"mid_third_mean_mib": mid_mean, "last_third_mean_mib": last_mean, "growth_pct": 100 * growth,
            "slope_last_half_mib_per_min": slope, "levelled": bool(growth <= tolerance)}


def summarize(args, budget, rec_: Recorder, load: dict, samples, probes, end: dict) -> tuple[list, list, dict]:
    records = rec_.records
    load_s = load["load_s"]
    outcomes = Counter(r["outcome"] for r in records)
    errors = Counter(r["error"] for r in records if r["outcome"] == "error")
    ok = [r for r in records if r["outcome"] == "ok"]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    latency = [r["latency"] for r in ok]
    tokens_clients = sum(r["tokens"] or 0 for r in records)
    during = [s for s in samples if 0 <= s["t"] <= load_s and "blocks_used" in s]
    first = next((s for s in samples if "generated_tokens" in s), {})
    last_load = during[-1] if during else {}
    gen = (last_load.get("generated_tokens", 0) - first.get("generated_tokens", 0))
    pre = last_load.get("preemptions", 0) - first.get("preemptions", 0)
    probe_lat = [p["latency_s"] for p in probes]
    probe_fail = [p for p in probes if not p["ok"]]
    rss = [s["rss_mib"] for s in samples if "rss_mib" in s]
    fds = [s["fds"] for s in samples if "fds" in s]
    threads = [s["threads"] for s in samples if "threads" in s]
    trend = rss_trend(samples, load_s, args.rss_tolerance / 100)
    final = end.get("final_stats", {})
    idle = end.get("idle_after_s") is not None
    client_5xx = sum(1 for r in records if (r.get("status") or 0) >= 500)
    checks = {
        "no request errors": not errors,
        "no health-probe failures": not probe_fail,
        "hang-up aborts the request (preflight)": bool(end.get("abort_check", {}).get("ok")),
        "server idle after the load": end.get("idle_after_s") is not None,
        "no leaked blocks after idle": idle and final.get("blocks_used") == 0,
        "pool empty again after the greedy re-run": end.get("post_greedy_blocks_used") == 0,
        "greedy answer unchanged by the soak": end.get("greedy_after") is not None
                                               and end.get("greedy_before") == end.get("greedy_after"),
        "no 5xx (clients and /metrics)": client_5xx == 0 and end.get("metrics", {}).get("server_5xx") == 0,
        "no traceback in the server log": not end.get("tracebacks"),
        "server alive through the load": not load.get("server_died"),
        "server exits cleanly on SIGINT": end.get("shutdown", {}).get("returncode") == 0,
        "RSS levelled off": trend.get("levelled") is not False,
        "preemption exercised": pre > 0,
    }
    failed = [k for k, v in checks.items() if not v]
    table = [
        ("load duration (min)", load_s / 60),
        ("clients / hang-up share / n>1 share", f"{args.clients} / {args.hangup_share:g} / {args.n_share:g}"),
        ("KV budget (tokens) / blocks", f"{budget} / {final.get('blocks_total', budget // args.block_size)}"),
        ("requests started", len(records)),
        ("completed", outcomes["ok"]),
        ("hung up on purpose", outcomes["hangup"]),
        ("cancelled at stop", outcomes["cancelled"]),
        ("errors", outcomes["error"]),
        ("errors by kind", ", ".join(f"{k}: {v}" for k, v in errors.most_common()) or "none"),
        ("tokens received by clients", tokens_clients),
        ("tokens generated by the engine", gen),
        ("engine tokens/s (mean)", gen / load_s if load_s else None),
        ("completed requests/min", outcomes["ok"] / load_s * 60 if load_s else None),
        ("TTFT p50 / p95 (s)", f"{pct(ttft, 50) or 0:.2f} / {pct(ttft, 95) or 0:.2f}"),
        ("latency p50 / p95 / max (s)",
         f"{pct(latency, 50) or 0:.2f} / {pct(latency, 95) or 0:.2f} / {max(latency, default=0):.2f}"),
        ("preemptions (total, per min)", f"{pre} ({pre / load_s * 60 if load_s else 0:.1f}/min)"),
        ("blocks used peak / mean", f"{max((s['blocks_used'] for s in during), default=0)} / "
                                    f"{np.mean([s['blocks_used'] for s in during]) if during else 0:.1f}"),
        ("running requests peak / waiting peak",
         f"{max((s.get('running_requests', 0) for s in during), default=0)} / "
         f"{max((s.get('waiting_requests', 0) for s in during), default=0)}"),
        ("prefix-cache hit rate (end)", final.get("prefix_hit_rate")),
        ("health probes / failures", f"{len(probes)} / {len(probe_fail)}"),
        ("probe latency p50 / p95 / max (s)",
         f"{pct(probe_lat, 50) or 0:.3f} / {pct(probe_lat, 95) or 0:.3f} / {max(probe_lat, default=0):.3f}"),
        ("RSS start / peak / end (MiB)", f"{rss[0] if rss else 0:.0f} / {max(rss, default=0):.0f} / "
                                         f"{rss[-1] if rss else 0:.0f}"),
        ("RSS mean middle third / last third (MiB)",
         f"{trend.get('mid_third_mean_mib') or 0:.1f} / {trend.get('last_third_mean_mib') or 0:.1f}"),
        ("RSS growth last vs middle third (%)", trend.get("growth_pct")),
        ("RSS slope over the last half (MiB/min)", trend.get("slope_last_half_mib_per_min")),
        ("RSS levelled off", trend.get("levelled")),
        ("open fds start / end", f"{fds[0] if fds else '-'} / {fds[-1] if fds else '-'}"),
        ("threads start / end", f"{threads[0] if threads else '-'} / {threads[-1] if threads else '-'}"),
        ("idle after the load (s)", end.get("idle_after_s") if idle else
         f"not within {args.idle_timeout:g} s: {final.get('running_requests')} running, "
         f"{final.get('waiting_requests')} waiting, {final.get('swapped_requests')} swapped"),
        ("leaked blocks after idle (blocks_used)", final.get("blocks_used") if idle else
         f"n/a ({final.get('blocks_used')} used, not idle)"),
        ("blocks cached / free after idle", f"{final.get('blocks_cached')} / {final.get('blocks_free')}"),
        ("hang-up preflight: idle after (s)", end.get("abort_check", {}).get("idle_after_s")),
        ("greedy answer unchanged", end.get("greedy_before") == end.get("greedy_after")),
        ("5xx seen by clients / in /metrics", f"{client_5xx} / {end.get('metrics', {}).get('server_5xx')}"),
        ("tracebacks in the server log (distinct)",
         f"{end.get('tracebacks_total', 0)} ({len(end.get('tracebacks', []))})"),
        ("server exit status", end.get("shutdown", {}).get("returncode")),
        ("verdict", "PASS" if not failed else "FAIL: " + "; ".join(failed)),
    ]
    rows = [{"metric": k, "value": v} for k, v in table]
    per_api = []
    for api in APIS:
        for stream in (True, False):
            rs = [r for r in records if r["api"] == api and r["stream"] == stream]
            if not rs:
                continue
            c = Counter(r["outcome"] for r in rs)
            lat = [r["latency"] for r in rs if r["outcome"] == "ok"]
            per_api.append({"api": api, "stream": stream, "requests": len(rs), "completed": c["ok"],
                            "hung up": c["hangup"], "cancelled": c["cancelled"], "errors": c["error"],
                            "n>1": sum(r["n"] > 1 for r in rs), "tokens": sum(r["tokens"] or 0 for r in rs),
                            "latency p50 (s)": pct(lat, 50), "latency p95 (s)": pct(lat, 95)})
    summary = {"outcomes": dict(outcomes), "errors_by_kind": dict(errors), "tokens_clients": tokens_clients,
               "tokens_engine": gen, "preemptions": pre, "rss_trend": trend, "checks": checks, "failed": failed,
               "probe_failures": probe_fail[:50]}
    return rows, per_api, summary


def plot(path: Path, samples: list[dict], probes: list[dict], records: list[dict], load_s: float,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    rs = [s for s in samples if "rss_mib" in s]
    ax = axes[0][0]
    ax.plot([s["t"] / 60 for s in rs], [s["rss_mib"] for s in rs], "-", color="C0")
    ax.set(ylabel="server RSS (MiB)", title="memory")
    ps = [s for s in samples if "generated_tokens" in s]
    ax = axes[0][1]
    if len(ps) > 1:
        t = np.array([s["t"] for s in ps])
        g = np.array([s["generated_tokens"] for s in ps], dtype=float)
        rate = np.diff(g) / np.maximum(np.diff(t), 1e-9)
        ax.plot(t[1:] / 60, rate, "-", color="C1", alpha=0.4, label="per sample")
        w = max(1, int(30 / max(np.median(np.diff(t)), 1e-9)))
        if len(rate) >= w:
            ax.plot(t[w:] / 60, np.convolve(rate, np.ones(w) / w, mode="valid"), "-", color="C1",
                    label="30 s mean")
    failed = [r["t_end"] / 60 for r in records if r["outcome"] == "error"]
    if failed:
        ax.plot(failed, [0] * len(failed), "x", color="C3", label="failed request")
    if len(ps) > 1 or failed:
        ax.legend(loc="upper right")
    ax.set(ylabel="engine tokens/s", title="throughput")
    ax = axes[1][0]
    ax.plot([s["t"] / 60 for s in ps], [s["blocks_used"] for s in ps], "-", label="used")
    ax.plot([s["t"] / 60 for s in ps], [s.get("blocks_cached", 0) for s in ps], "-", label="cached")
    if ps:
        ax.axhline(ps[0]["blocks_total"], color="grey", lw=0.8, ls=":", label="total")
    ax2 = ax.twinx()
    ax2.plot([s["t"] / 60 for s in ps], [s.get("preemptions", 0) for s in ps], "-", color="C3", lw=1,
             label="preemptions (cumulative)")
    ax2.set_ylabel("preemptions", color="C3")
    ax.set(xlabel="minutes", ylabel="KV blocks", title="block pool")
    ax.legend(loc="upper left")
    ax = axes[1][1]
    good = [p for p in probes if p["ok"]]
    bad = [p for p in probes if not p["ok"]]
    ax.plot([p["t"] / 60 for p in good], [p["latency_s"] * 1000 for p in good], ".", ms=3, label="ok")
    if bad:
        ax.plot([p["t"] / 60 for p in bad], [p["latency_s"] * 1000 for p in bad], "x", color="C3",
                label="failed")
    ax.set(xlabel="minutes", ylabel="latency (ms)", title="health probe", yscale="log")
    ax.legend(loc="upper right")
    for row in axes:
        for a in row:
            a.axvline(load_s / 60, color="k", lw=0.8, ls="--")
    fig.suptitle(title + " (dashed: end of the load)")
    save_figure(fig, path)
    plt.close(fig)


# ---- main -------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--minutes", type=float, default=30, help="duration of the load")
    ap.add_argument("--hangup-share", type=float, default=0.2,
                    help="share of streaming requests that hang up mid-stream")
    ap.add_argument("--stream-share", type=float, default=0.8, help="share of streaming requests")
    ap.add_argument("--n-share", type=float, default=0.25, help="share of OpenAI requests with n=2..4")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--think", type=float, default=1.0, help="max pause between a client's requests (s)")
    add_options(ap, kv_budget=None, max_tokens=128, port=0, threads=2, ctx=4096, block_size=32, max_seqs=64,
                helps={"kv_budget": "server --kv-budget in tokens (default: 64 per client, at least 2048)",
                       "port": "server port (0: a free one)"})
    ap.add_argument("--preemption", default="recompute", choices=["recompute", "swap"])
    ap.add_argument("--sample-every", type=float, default=5.0, help="RSS / pool sampling period (s)")
    ap.add_argument("--probe-timeout", type=float, default=5.0, help="a slower health probe fails (s)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="read timeout per request (s)")
    ap.add_argument("--idle-timeout", type=float, default=300.0, help="wait this long for idle after the load")
    ap.add_argument("--rss-tolerance", type=float, default=2.0,
                    help="RSS levelled off if the last third's mean is within this %% of the middle third's")
    ap.add_argument("--progress-every", type=float, default=30.0)
    add_options(ap, seed=0)
    ap.add_argument("--label", default=None, help="results/soak_<label>.* instead of results/soak.*")
    args = ap.parse_args()

    name = f"soak_{args.label}" if args.label else "soak"
    budget = args.kv_budget or max(2048, 64 * args.clients)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS_DIR / f"{name}.server.log"
    cmd = server_command(args, port, budget)
    print("server:", " ".join(cmd), f"(log: {log_path})", flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    end: dict = {}
    load: dict = {"load_s": 0.0}
    sampler = prober = None
    rec_ = None
    try:
        startup_s = wait_healthy(url, proc, "/", 600)
        model = httpx.get(url + "/api/tags", timeout=30).json()["models"][0]["name"]
        print(f"server up in {startup_s:.1f} s, model {model}, KV budget {budget} tokens", flush=True)
        end["startup_s"] = startup_s
        end["greedy_before"] = greedy_text(url, model)
        with httpx.Client(base_url=url, timeout=60) as http:
            end["abort_check"] = abort_check(url, model, http)
        print("abort preflight:", end["abort_check"], flush=True)

        t0 = time.monotonic()
        sampler = Sampler(url, proc.pid, args.sample_every, t0)
        prober = Prober(url, args.probe_timeout, t0)
        sampler.start()
        prober.start()
        rec_ = Recorder(t0)
        load = asyncio.run(run_load(url, model, args, rec_, proc, sampler.samples))
        print(progress_line(rec_, sampler.samples), flush=True)
        if load["server_died"]:
            print(f"the server died during the load (status {proc.returncode})", flush=True)
        else:
            with httpx.Client(base_url=url, timeout=60) as http:
                end["idle_after_s"], end["final_stats"] = wait_idle(http, args.idle_timeout)
                print(f"idle after {end['idle_after_s']} s; pool: {end['final_stats']}", flush=True)
                end["greedy_after"] = greedy_text(url, model)
                _, stats = wait_idle(http, 30)
                end["post_greedy_blocks_used"] = stats.get("blocks_used")
            end["metrics"] = scrape_metrics(url)
            time.sleep(2 * args.sample_every)   # a little idle tail in the plot
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as e:
        end["fatal"] = f"{type(e).__name__}: {e}"
        print("fatal:", end["fatal"], flush=True)
    finally:
        for th in (sampler, prober):
            if th is not None:
                th.stop_event.set()
                th.join(70)
        end["shutdown"] = stop_server(proc)
        log.close()
    log_text = log_path.read_text(errors="replace")
    end["tracebacks_total"], end["tracebacks"] = tracebacks_in(log_text)
    if end["tracebacks_total"]:
        print(f"{end['tracebacks_total']} tracebacks in the server log, ending in:", flush=True)
        for tb in end["tracebacks"]:
            print("  " + tb.splitlines()[-1], flush=True)
    if rec_ is None:
        print(f"no load was run; server log: {log_path}", flush=True)
        return 1

    samples = sampler.samples
    probes = prober.probes
    rows, per_api, summary = summarize(args, budget, rec_, load, samples, probes, end)
    notes = ("Per API and streaming mode:\n\n" + markdown_table(per_api) + "\n"
             "Completed = read to the end and checked (status, framing, final done / [DONE], a finish_reason "
             "per choice, usage). Hung up = the client closed the connection after 0-5 content chunks on "
             "purpose; cancelled = in flight when the load stopped (all clients disconnect at once). "
             "Errors = any other non-2xx, transport error or malformed answer. Tokens received: usage / "
             "eval_count where the answer has it, otherwise content chunks. Leaked blocks = blocks_used "
             "once no request is running, waiting or swapped. RSS levelled off: mean of the last third of "
             "the load within " f"{args.rss_tolerance:g}% of the middle third's. Server log: "
             f"`bench/results/{log_path.name}` (not committed). Plot: `results/{name}.png`.")
    if summary["errors_by_kind"]:
        notes += "\n\nFirst error examples:\n\n```json\n" + \
                 json.dumps(dict(rec_.error_examples), indent=1)[:6000] + "\n```"
    data = {"params": {**vars(args), "kv_budget_tokens": budget, "server_command": cmd},
            "load": load, "summary": summary, "end": end, "per_api": per_api,
            "error_examples": dict(rec_.error_examples), "samples": samples, "probes": probes,
            "requests": rec_.records}
    paths = write_results(name, data, rows, title=f"Soak: {args.clients} clients, {load['load_s'] / 60:.1f} min, "
                                                  f"KV budget {budget} tokens",
                          notes=notes, columns=["metric", "value"])
    plot(RESULTS_DIR / f"{name}.png", samples, probes, rec_.records, load["load_s"],
         f"soak: {args.clients} clients, KV budget {budget} tokens")
    print(markdown_table(rows, ["metric", "value"]))
    print(markdown_table(per_api))
    print("wrote", paths["json"], paths["md"], RESULTS_DIR / f"{name}.png", flush=True)
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
